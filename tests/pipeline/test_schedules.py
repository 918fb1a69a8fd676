"""Pipeline schedules as data: every schedule's rank lists cover each (stage, microbatch) once
per action kind, follow the schedule's definition, and play without deadlock; ZB-H1's
predicted bubble is below 1F1B's."""

import collections

import pytest
from hypothesis import given
from hypothesis import strategies as st

import fsg
from fsg._src.pipeline.actions import Action, Schedule
from fsg._src.pipeline.schedules import SCHEDULES, make_schedule
from fsg._src.pipeline.simulate import Cost, simulate


@st.composite
def schedule_strategy(draw, names=SCHEDULES):
    """A buildable schedule: its name, pp, virtual stages and microbatch count."""
    name = draw(st.sampled_from(names))
    pp = draw(st.integers(1, 6))
    virtual = draw(st.integers(2, 3)) if name == "interleaved" else 1
    if name == "interleaved":
        m = pp * draw(st.integers(1, 4))
    elif name == "gpipe":
        m = draw(st.integers(1, 10))
    else:
        m = draw(st.integers(pp, pp + 8))
    return make_schedule(name, pp, m, virtual=virtual)


def in_flight(actions, kind_done="W"):
    """The most microbatches a rank holds at once: forwards run whose ``kind_done`` has not."""
    live, most = 0, 0
    for a in actions:
        live += a.kind == "F"
        live -= a.kind == kind_done
        most = max(most, live)
    return most


@given(schedule_strategy())
def test_every_action_runs_once_on_its_stages_rank(s):
    want = {Action(k, stage, m) for k in "FBW" for stage in range(s.num_stages) for m in range(s.num_microbatches)}
    seen = collections.Counter(a for rank in s.actions for a in rank)
    assert set(seen) == want and set(seen.values()) == {1}
    for rank, actions in enumerate(s.actions):
        assert all(s.rank_of(a.stage) == rank for a in actions)


@given(schedule_strategy())
def test_no_schedule_deadlocks_and_w_follows_b(s):
    timeline = simulate(s, Cost(1.0, 1.0, 1.0, p2p=0.1))
    assert 0.0 <= timeline.bubble < 1.0
    for rank, events in enumerate(timeline.events):
        assert [e.action for e in events] == list(s.actions[rank])  # played in the rank's order
        order = {a: i for i, a in enumerate(s.actions[rank])}
        assert all(order[a] < order[a._replace(kind="W")] for a in order if a.kind == "B")
    for t in s.transfers():  # every message goes to another rank and is sent before it is needed
        assert t.src != t.dst and t.consumer in s.actions[t.dst]


@given(schedule_strategy(("gpipe",)))
def test_gpipe_runs_every_forward_first(s):
    for actions in s.actions:
        kinds = [a.kind for a in actions]
        assert kinds == ["F"] * s.num_microbatches + ["B", "W"] * s.num_microbatches


@given(schedule_strategy(("1f1b", "zbh1")))
def test_1f1b_and_zbh1_warm_up_and_in_flight(s):
    for rank, actions in enumerate(s.actions):
        first_b = next(i for i, a in enumerate(actions) if a.kind == "B")
        assert first_b == s.pp - rank  # pp - rank - 1 warm-up forwards, then one more forward
        assert in_flight(actions) <= (s.pp - rank if s.name == "1f1b" else s.pp)
        if s.name == "1f1b":  # a full backward: W at once after its B
            assert all(actions[i + 1] == a._replace(kind="W") for i, a in enumerate(actions) if a.kind == "B")


@given(schedule_strategy(("interleaved",)))
def test_interleaved_warm_up_follows_megatron(s):
    total = s.num_microbatches * s.virtual
    for rank, actions in enumerate(s.actions):
        warm = min((s.virtual - 1) * s.pp + 2 * (s.pp - rank - 1), total)
        first_b = next(i for i, a in enumerate(actions) if a.kind == "B")
        assert first_b == min(warm + 1, total)
        forwards = [a for a in actions if a.kind == "F"]
        # rounds of pp microbatches through each of the rank's stages in turn
        assert [a.stage for a in forwards[: s.pp]] == [rank] * s.pp


@given(st.integers(2, 6), st.integers(0, 8))
def test_zbh1_bubble_is_below_1f1bs(pp, extra):
    m = pp + extra
    cost = Cost(forward=1.0, backward_input=1.0, backward_weight=1.0)  # B and W: halves of a full backward
    one_f_one_b = simulate(make_schedule("1f1b", pp, m), cost).bubble
    zero_bubble = simulate(make_schedule("zbh1", pp, m), cost).bubble
    assert zero_bubble < one_f_one_b
    assert one_f_one_b == pytest.approx((pp - 1) / (m + pp - 1))  # 1F1B's textbook bubble


def test_a_deadlocking_order_is_named():
    actions = (
        (Action("F", 0, 0), Action("B", 0, 0), Action("W", 0, 0)),
        (Action("B", 1, 0), Action("F", 1, 0), Action("W", 1, 0)),  # B before its own F
    )
    with pytest.raises(fsg.ArgumentError, match=r"deadlocks: .*rank 1 at B1\.0 waits for F1\.0"):
        simulate(Schedule("bad", 2, 1, 1, actions))


@pytest.mark.parametrize(
    ("name", "pp", "m", "v", "match"),
    [
        ("1f1b", 4, 3, 1, "needs at least 4 microbatches"),
        ("zbh1", 2, 1, 1, "needs at least 2 microbatches"),
        ("interleaved", 4, 6, 2, "not a multiple of 4"),
        ("interleaved", 2, 4, 1, "virtual_stages=2 or more"),
        ("gpipe", 2, 4, 2, "runs one stage per rank"),
        ("dualpipe", 2, 4, 1, "unknown"),
        ("gpipe", 2, 0, 1, "must be an int >= 1"),
    ],
)
def test_unbuildable_schedules_are_refused(name, pp, m, v, match):
    with pytest.raises(fsg.ArgumentError, match=match):
        make_schedule(name, pp, m, virtual=v)


def test_a_timeline_draws_as_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "t.png"
    simulate(make_schedule("interleaved", 2, 2, virtual=2)).draw(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
