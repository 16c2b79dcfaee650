"""Lesson 01: autograd from scratch, then a tiny GPT trained on real text, on one CPU.

    python lessons/01_autograd.py

(under a minute on two CPU cores; ``--quick`` is a few-second smoke run, the one the tests use).

Part 1 builds a five-node graph by hand and checks every gradient the engine computes against the
chain rule worked out on paper. Part 2 puts the same engine under a GPT-2 shaped model
(``minipar.nn.GPT``: 2 blocks, 64 channels, 4 heads, 32 characters of context, about 110 k
parameters) and trains it with AdamW to predict the next character of the Python documentation
that ships with Python itself (``pydoc_data``, 465 KB of English). The loss starts at
ln(vocab) ≈ 4.6 (a uniform guess over 103 characters); the lesson passes when the validation loss
falls below 1.6 nats per character, i.e. the model has learnt spelling and common words. Each step
is forward (build the graph), backward (walk it in reverse), update (no graph).

Read next: minipar/autograd.py, ops.py, graph.py, functional.py, then minipar/nn/; proved by
tests/test_autograd_gradcheck.py.
"""
import math
import time

import minipar
import minipar.nn as nn
from minipar import optim
from minipar.data import CharTokenizer, get_batch, load_text

from _kit import arguments, check, finish

TARGET = 1.6  # validation loss (nats per character) the full run must reach


def part1_tiny_graph():
    print("Part 1: a graph you can check by hand")
    a = minipar.tensor(2.0, requires_grad=True)
    b = minipar.tensor(-3.0, requires_grad=True)
    c = a * b                   # c = ab = -6
    d = c + a ** 2              # d = ab + a² = -2
    e = d.tanh()                # e = tanh(d)
    e.backward()
    de = 1 - math.tanh(-2.0) ** 2   # de/dd = 1 − tanh²(d)
    print(f"  e = tanh(ab + a²) = {e.item():.5f} at a = 2, b = -3")
    print(f"  de/da = (b + 2a)(1 − e²) = {a.grad.item():+.5f}   (by hand {(-3 + 4) * de:+.5f})")
    print(f"  de/db = a(1 − e²)        = {b.grad.item():+.5f}   (by hand {2 * de:+.5f})")
    worst = max(abs(a.grad.item() - (-3 + 4) * de), abs(b.grad.item() - 2 * de))
    check("the engine's gradients equal the chain rule by hand", worst < 1e-5,
          "|diff| < 1e-5 (float32)", f"{worst:.1e}")


@minipar.no_grad()
def estimate_loss(model, data, batches, block_size):
    """Mean loss over a fixed set of batches (same seed every call: comparable numbers)."""
    model.eval()
    with minipar.random.fork_rng():
        minipar.manual_seed(1234)
        losses = [model(*get_batch(data, 32, block_size))[1].item() for _ in range(batches)]
    model.train()
    return sum(losses) / len(losses)


def part2_train_gpt(args):
    print("\nPart 2: a tiny GPT learns to write like the Python docs")
    text = load_text("pydoc")
    tok = CharTokenizer(text)
    data = tok.encode(text)
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    config = nn.GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=4,
                          n_embd=64)
    minipar.manual_seed(args.seed)
    model = nn.GPT(config)
    opt = optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    print(f"  {len(text):,} characters, vocabulary {tok.vocab_size}, "
          f"{model.num_parameters():,} parameters; {args.steps} steps of batch {args.batch_size}")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = get_batch(train, args.batch_size, config.block_size)
        _, loss = model(x, y)           # forward: builds the graph
        opt.zero_grad()
        loss.backward()                 # backward: gradients of every parameter
        optim.clip_grad_norm_(model.parameters(), 1.0)
        opt.lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))  # cosine decay
        opt.step()                      # update: on the arrays, no graph
        if step % args.log_every == 0 or step == args.steps:
            print(f"  step {step:5d}  train loss {loss.item():.3f}  "
                  f"({time.perf_counter() - start:5.1f} s)")
    val_loss = estimate_loss(model, val, 4 if args.quick else 20, config.block_size)
    elapsed = time.perf_counter() - start
    prompt = tok.encode("The ")[None]
    sample = tok.decode(model.generate(prompt, 160, temperature=0.8)[0])
    print(f"\n  sample: {sample!r}\n")
    print(f"  validation loss {val_loss:.3f} (uniform guess {math.log(tok.vocab_size):.3f}) "
          f"after {elapsed:.1f} s")
    return val_loss


def main(argv=None):
    args = arguments(__doc__, ("--steps", 2000), ("--batch-size", 16), ("--lr", 3e-3),
                     ("--seed", 0), ("--log-every", 100),
                     quick="30 steps: the loss must fall below the uniform guess minus 1",
                     argv=argv)
    if args.quick:
        args.steps, args.log_every = min(args.steps, 30), 10
    part1_tiny_graph()
    val_loss = part2_train_gpt(args)
    uniform = math.log(103)  # the vocabulary of pydoc_data's text
    target = uniform - 1 if args.quick else TARGET  # 30 steps learn letter frequencies only
    check(f"validation loss below {target:.2f} nats per character", val_loss < target,
          f"< {target:.2f}", f"{val_loss:.3f}")
    return finish(f"gradients by hand, and the GPT learns (validation loss {val_loss:.3f})")


if __name__ == "__main__":
    raise SystemExit(main())
