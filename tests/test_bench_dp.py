"""bench_dp.py's closing summary, from launches given here: the goals of issue 15 at each
per-rank batch with their range over launches, and DDP's overlap default beside the measured
gain from overlap in each configuration."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def bench_dp():
    spec = importlib.util.spec_from_file_location("script_bench_dp",
                                                  ROOT / "scripts" / "bench_dp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch(one, two, torch):
    """{n: {run: seconds}}: 1 rank at ``one`` s a step, 2 ranks at ``two`` with overlap on (off
    1.2x slower), torch DDP at ``torch`` on 2 ranks."""
    runs = lambda t, ddp: {"no comm": 0.9 * t, "overlap on": t, "overlap off": 1.2 * t,  # noqa
                           "torch DDP": ddp}
    return {1: runs(one, one), 2: runs(two, torch)}


def test_summary_gives_each_goal_at_each_batch_and_the_default_beside_the_gain(capsys):
    dp = bench_dp()
    per_batch = {64: [launch(1.0, 1.0, 1.5)] * 3,  # 2.00, minipar / torch 0.67
                 256: [launch(1.0, 1.05, 1.2), launch(1.0, 1.1, 1.2), launch(1.0, 1.25, 1.2)]}
    defaults = {1: (True, "overlap on: 1 rank(s) on 2 usable cores leave 1 idle ..."),
                2: (False, "overlap off: 2 rank(s) on 2 usable cores leave no core idle ...")}
    dp.summary(per_batch, defaults)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "summary, samples per rank 64, 256:"
    # 256: medians 1.90 but one launch at 2 / 1.25 = 1.60 < 1.7
    assert lines[2] == ("  2-rank / 1-rank throughput, overlap on: 64: 2.00 (launches "
                        "2.00-2.00), 256: 1.82 (launches 1.60-1.90, goal missed) (goal >= 1.8 "
                        "at 256, no launch below 1.7)")
    assert lines[3] == ("  minipar / torch DDP step time, 2 ranks, overlap on: 64: 0.67 (launches "
                        "0.67-0.67), 256: 0.92 (launches 0.88-1.04, goal missed) (goal <= 0.8)")
    assert lines[4] == ("  minipar / torch DDP step time, 2 ranks, overlap off (DDP's default): "
                        "64: 0.80 (launches 0.80-0.80), 256: 1.10 (launches 1.05-1.25, goal "
                        "missed) (goal <= 0.8)")
    assert lines[5].startswith("  DDP's overlap default on 2 ranks: overlap off: 2 rank(s) on 2 ")
    assert lines[5].endswith("measured gain from overlap (off / on step time) 64: 1.20x, "
                             "256: 1.20x: the default is the slower at 64, the slower at 256")
    ms = {"overlap on": 1.0, "overlap off": 1.04}
    assert [dp.verdict(ms, on) for on in (True, False)] == ["as fast (within 5%)"] * 2
    ms["overlap off"] = 0.9
    assert [dp.verdict(ms, on) for on in (True, False)] == ["the slower", "the faster"]
    assert len(lines) == 6  # one rank: nothing to overlap, no line


def test_default_scaling_gives_ddp_s_default_beside_the_no_communication_ceiling(capsys):
    """The overlap DDP chooses on each rank count (on for 1 rank, off for 2): 2-rank / 1-rank
    of those runs, the same of "no comm" (the ceiling), and their ratio with its range."""
    dp = bench_dp()
    slow_compute = launch(1.0, 0.95, 1.0)
    slow_compute[2]["no comm"] = 1.0  # ceiling 2 x 0.9 / 1.0 = 1.80, default 2 / 1.14: 0.97 of it
    per_batch = {64: [launch(1.0, 1.0, 1.5)] * 2,  # default 2 x 1.0 / 1.2 = 1.67, ceiling 2.00
                 256: [launch(1.0, 0.9, 1.0), slow_compute]}  # the first 1.85 of 2.22: 0.83
    defaults = {1: (True, "overlap on: ..."), 2: (False, "overlap off: ...")}
    dp.default_scaling(per_batch, defaults)
    assert capsys.readouterr().out.splitlines() == [
        "  2-rank / 1-rank throughput, DDP's default settings (1 rank: overlap on, 2 ranks: "
        "overlap off): 64: 1.67, ceiling 2.00, 0.83 of it (launches 0.83-0.83), 256: 1.80, ceiling "
        "1.99, 0.91 of it (launches 0.83-0.97, goal missed) (goal >= 1.8 and >= 0.95 of the "
        "no-communication ceiling at 256)"]
    per_batch[256] = [launch(1.0, 0.9, 1.0)] * 2
    dp.default_scaling(per_batch, {1: (True, ""), 2: (True, "")})  # overlap on everywhere
    assert capsys.readouterr().out.endswith(
        "256: 2.22, ceiling 2.22, 1.00 of it (launches 1.00-1.00) (goal >= 1.8 and >= 0.95 of "
        "the no-communication ceiling at 256)\n")
