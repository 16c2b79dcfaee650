"""The cost model's fit on a loaded machine: a size's constant is its fastest round, and a stall
(a round, or every round, far slower than the curve) is found and measured again, not fitted."""
import pytest

from minipar.comm.fit import in_line, slopes, stalled, unconfirmed
from minipar.testing import run_on_ranks

CLEAN = {1 << 15: [40e-6, 41e-6, 44e-6], 1 << 16: [60e-6, 63e-6, 61e-6],
         1 << 17: [90e-6, 92e-6, 95e-6]}


def test_a_clean_curve_has_no_stall():
    assert stalled(CLEAN) == []
    assert stalled({1 << 16: [60e-6]}) == []  # one round: nothing to confirm it against


def test_an_unconfirmed_fastest_round_is_stalled():
    """Two of three rounds hit a burst: the fastest has no second round within 25 %."""
    samples = {**CLEAN, 1 << 16: [60e-6, 900e-6, 2e-3]}
    assert stalled(samples) == [1 << 16]
    assert stalled(samples, agree=100) == []


def test_an_algorithm_s_alpha_is_unconfirmed_until_two_batches_agree():
    assert unconfirmed({"ring": [20e-6, 24e-6, 90e-6], "sharded_ps": [20e-6, 60e-6]}) == [
        "sharded_ps"]


def test_a_stalled_latency_is_measured_again_and_capped():
    """The tiny message's time is subtracted from every size's: stalled, it would zero them."""
    samples = {8: [300e-6, 310e-6], **CLEAN}
    assert stalled(samples) == [8] and in_line(samples)[8] == 40e-6


def test_a_size_dearer_than_the_next_is_stalled():
    """Every round at 64 KiB stalled alike (confirmed, but more than 128 KiB costs)."""
    samples = {**CLEAN, 1 << 16: [2.0e-3, 2.1e-3, 2.2e-3]}
    assert stalled(samples) == [1 << 16]
    samples[1 << 16] = [95e-6, 96e-6, 97e-6]  # within 10 % of the next size: noise, not a stall
    assert stalled(samples) == []


def test_a_stall_that_outlasted_the_retries_is_capped_by_the_next_size():
    samples = {**CLEAN, 1 << 16: [2.0e-3, 2.1e-3]}
    assert in_line(samples) == {1 << 15: 40e-6, 1 << 16: 90e-6, 1 << 17: 90e-6}
    assert in_line(CLEAN) == {m: min(ts) for m, ts in CLEAN.items()}


def fit_body(stalls):
    """Fit at 32-128 KiB with ``stalls`` fake stalls of 1 s added to the first ring steps
    timed at 64 KiB (the same on every rank, as a slowest-rank time is)."""
    from minipar.comm import fit, world

    comm, real, hit = world(), fit.exchange_time, []

    def exchange_time(c, nbytes, *args, **kwargs):
        seconds = real(c, nbytes, *args, **kwargs)
        if nbytes == 1 << 16 and len(hit) < stalls:
            hit.append(nbytes)
            seconds += 1.0
        return seconds
    fit.exchange_time = exchange_time
    try:
        model = fit.fit(comm, sizes=(1 << 15, 1 << 16, 1 << 17), algorithms=("ring",))
    finally:
        fit.exchange_time = real
    return {"beta_64k": model.betas[1 << 16], "refitted": {str(k): v for k, v in
                                                          model.refitted.items()},
            "unsettled": model.unsettled, "alphas": sorted(model.alphas)}


@pytest.mark.mpi
def test_fit_measures_stalls_again_and_keeps_them_out_of_the_model():
    """One stalled round (the other two stand) and three (every first-pass round stalled, so
    only the retries see the real cost): beta at 64 KiB is the real one (a 1 s stall would
    read as 1.5e-5 s per byte; 100 ms a step, 1.5e-6, is slower than any loaded machine) and
    the size was measured again."""
    for stalls in (1, 3):
        got = run_on_ranks(fit_body, 2, args=(stalls,))
        assert got[0] == got[1], got  # every rank fitted the same model
        assert got[0]["beta_64k"] < 1.5e-6, (stalls, got[0])
        assert got[0]["refitted"].get(str(1 << 16), 0) >= (1 if stalls == 3 else 0), got[0]
        assert got[0]["alphas"] == ["ring"]


def held_out_body():
    from minipar import bench
    from minipar.comm import world

    held = []
    rows = bench.run_bench(world(), [1 << 17], ["ring"], 0, as_json=False, held_out=held)
    return {"rows": [(r["bytes"], r["algorithm"]) for r in rows],
            "held": [(r["bytes"], r["algorithm"], r["measured_over_model"] > 0,
                      abs(r["time_us"] / r["model_us"] - r["measured_over_model"]) < 1e-9)
                     for r in held]}


@pytest.mark.mpi
def test_benchmark_checks_the_model_at_a_size_it_never_fitted():
    """After the table: the ring at 96 KiB (between the fitted 64 and 128 KiB) as measured /
    model, then the range line; the table's rows are what they were."""
    values = run_on_ranks(held_out_body, 2)
    assert values[0]["rows"] == [[1 << 17, "mpi"], [1 << 17, "ring"]]
    assert values[0]["held"] == [[3 << 15, "ring", True, True]]
    lines = values.outputs[0].splitlines()
    assert any(line.startswith("# one_way_beta_GBps ") and "128KiB" in line for line in lines)
    start = lines.index("# held out of the fit (sizes between its powers of two; fastest of 3 "
                        "rounds, as the fit): measured / model")
    assert lines[start + 2].split()[:3] == ["#", "98304", "ring"]
    assert lines[start + 3].startswith("# measured / model from 64KiB up: held out ")
    assert "over 1 rows" in lines[start + 3] and "goal 0.8-1.25" in lines[start + 3]
    assert lines[start + 4].startswith("# held out, per algorithm: ring ")


def test_a_latency_as_dear_as_a_size_leaves_no_zero_beta():
    """A stalled latency capped at 32 KiB's time would make beta(32 KiB) zero (an infinite
    bandwidth, and a division by zero where it is printed): that size takes its neighbours'."""
    send = {8: 4e-5, 32768: 4e-5, 65536: 5e-5, 131072: 6e-5}
    betas = slopes(send, 8)
    assert betas[65536] == pytest.approx((5e-5 - 4e-5) / (65536 - 8))
    assert betas[32768] == betas[65536]  # beyond the readable sizes: the nearest one's
    assert slopes({8: 1e-5, 4096: 1e-5}, 8) == {4096: 1e-5 / 4096}  # none readable


def test_settle_measures_each_key_once_a_round_then_the_unsettled_again():
    from minipar.comm import fit
    calls, samples = [], {"a": [], "b": []}

    def measure(key):
        calls.append(key)
        samples[key].append(len(calls))
    unsettled = lambda: ["b"] if len(samples["b"]) < 4 else []  # noqa: E731
    again = fit.settle(["a", "b"], measure, unsettled, rounds=2, retries=3,
                       progress=lambda keys: iter(list(keys)))
    assert calls == ["a", "b", "a", "b", "b", "b"]  # the keys take turns; b twice more
    assert again == {"b": 2}


def test_timed_counts_the_slowest_rank_of_each_call():
    from minipar.comm import fit

    class TwoRanks:  # this rank and one twice as slow
        def barrier(self):
            pass

        def all_gather_object(self, times):
            self.mine = times
            return [times, [2 * t for t in times]]
    comm, calls = TwoRanks(), []
    each = fit.timed(comm, lambda: calls.append(1), 3, warmup=1, statistic=list)
    assert len(calls) == 4 and each == [2 * t for t in comm.mine] and len(each) == 3
    median = fit.timed(comm, lambda: None, 3, warmup=0)
    assert median == sorted(2 * t for t in comm.mine)[1]


def test_the_held_out_line_per_algorithm_gives_each_range_and_those_outside_the_goal():
    from minipar import bench
    rows = [{"bytes": m, "algorithm": a, "measured_over_model": q} for m, a, q in [
        (3 << 15, "ring", 0.95), (3 << 19, "ring", 1.1), (3 << 15, "sequential", 0.73),
        (3 << 19, "sequential", 0.9), (3 << 10, "sequential", 3.0),  # below 64 KiB: not checked
        (3 << 15, "parallel", None)]]  # no formula: no range
    assert bench.per_algorithm(rows) == ("# held out, per algorithm: ring 0.95-1.10, sequential "
                                         "0.73-0.90; outside the goal 0.8-1.25: sequential")
    assert bench.per_algorithm([]) == ("# held out, per algorithm: -; outside the goal 0.8-1.25: "
                                       "none")


# one-way beta 1 ns a byte, the exchange's 2 ns: a megabyte costs 1 ms one way, 2 ms both ways
ONE_WAY = {"alpha": 0.0, "betas": {1: 2e-9}, "gammas": {1: 0.0}, "one_way": {1: 1e-9}}


def test_one_way_algorithms_are_priced_with_the_one_way_beta():
    """sequential and the parameter server send one way: 2(p-1) messages at the one-way beta;
    the ring exchanges, at the exchange's beta, whatever the model holds."""
    from minipar.comm import cost
    model = cost.Model(**ONE_WAY)
    n = 1 << 20
    for algorithm in ("sequential", "parameter_server"):
        assert cost.predict("all_reduce", algorithm, 2, n, model) == pytest.approx(2 * n * 1e-9)
    assert cost.predict("all_reduce", "ring", 2, n, model) == pytest.approx(2 * n / 2 * 2e-9)
    assert model.one_way_beta(n) == 1e-9 and model.beta(n) == 2e-9


def test_a_model_without_a_one_way_beta_prices_every_algorithm_with_the_exchange_s():
    """plan/hardware.py's Model(alpha, {1: beta}, {1: gamma}): as before the one-way beta."""
    from minipar.comm import cost
    model = cost.Model(0.0, {1: 2e-9}, {1: 0.0})
    n = 1 << 20
    assert model.one_way == {} and model.one_way_beta(n) == 2e-9
    assert cost.predict("all_reduce", "sequential", 2, n, model) == pytest.approx(2 * n * 2e-9)


def test_minipar_cost_takes_an_optional_one_way_beta_and_names_a_bad_value(monkeypatch):
    from minipar.comm import cost
    monkeypatch.setattr(cost, "_fitted", {})
    monkeypatch.setenv("MINIPAR_COST", "5e-6,2e-9,1e-10")
    model = cost.default_model()
    assert (model.alpha, model.beta(1 << 20), model.gamma(8)) == (5e-6, 2e-9, 1e-10)
    assert model.one_way_beta(1 << 20) == 2e-9  # none given: the exchange's
    monkeypatch.setenv("MINIPAR_COST", "5e-6,2e-9,1e-10,1e-9")
    assert cost.default_model().one_way_beta(1 << 20) == 1e-9
    for text, why in [("5e-6,2e-9", "give alpha,beta,gamma or alpha,beta,gamma,one_way_beta"),
                      ("5e-6,fast,1e-10", "beta 'fast' is not a number"),
                      ("5e-6,2e-9,1e-10,-1e-9", "one_way_beta must be >= 0, not -1e-9")]:
        monkeypatch.setenv("MINIPAR_COST", text)
        with pytest.raises(ValueError, match=why):
            cost.default_model()


def one_way_fit_body():
    from minipar.comm import cost, fit, world
    model = fit.fit(world(), sizes=(1 << 15, 1 << 16), algorithms=("sequential",))
    n = 3 << 15
    return {"sizes": sorted(model.one_way), "positive": min(model.one_way.values()) > 0,
            "sequential": cost.predict("all_reduce", "sequential", 2, n, model),
            "by_hand": (2 * (model.alphas["sequential"] + n * model.one_way_beta(n))
                        + n * model.gamma(n))}


@pytest.mark.mpi
def test_fit_measures_a_one_way_beta_that_sequential_is_priced_with():
    got = run_on_ranks(one_way_fit_body, 2)
    assert got[0]["sizes"] == [1 << 15, 1 << 16] and got[0]["positive"], got[0]
    assert got[0]["sequential"] == pytest.approx(got[0]["by_hand"])


def test_one_way_time_on_two_fake_ranks_sends_from_rank_0_and_receives_on_rank_1():
    from minipar.comm import fit

    class Rank:  # a communicator that records its point-to-point calls
        def __init__(self, rank):
            self.rank, self.size, self.calls = rank, 3, []

        def barrier(self):
            pass

        def all_gather_object(self, times):
            return [times]

        def send(self, x, dest):
            self.calls.append(("send", x.nbytes, dest))

        def recv(self, out, source):
            self.calls.append(("recv", out.nbytes, source))
    ranks = [Rank(r) for r in range(3)]
    for r in ranks:
        fit.one_way_time(r, 64, iters=2, span=2)
    assert ranks[0].calls == [("send", 64, 1)] * 5  # 3 warm-up calls and 2 timed
    assert ranks[1].calls == [("recv", 64, 0)] * 5 and ranks[2].calls == []


def test_auto_keeps_its_choice_per_model_and_asks_again_for_a_new_fit(monkeypatch):
    from minipar.comm import allreduce, cost
    monkeypatch.setattr(cost, "_fitted", {})
    latency = cost.Model(1e-3, {1: 1e-12}, {1: 1e-12})  # steps dominate: the fewest win
    bandwidth = cost.Model(0.0, {1: 1e-9}, {1: 1e-9})   # bytes dominate: the fewest sent win
    picks = []
    for model in (latency, bandwidth, latency):
        cost.use(model)  # what fit does with each new fit
        picks.append(allreduce.choose(8, 1 << 20))
        assert picks[-1] == cost.cheapest("all_reduce", cost.AUTO_CANDIDATES, 8, 1 << 20, model)
    assert picks[0] == picks[2] != picks[1]
    # MINIPAR_COST's text is read into one model, whose choices are kept like a fit's
    monkeypatch.setattr(cost, "_fitted", {})
    monkeypatch.setenv("MINIPAR_COST", "1e-3,1e-12,1e-12")
    assert cost.default_model() is cost.default_model()
    assert allreduce.choose(8, 1 << 20) == picks[0]
