"""The `--ray` scheduler without Ray (evalrun/scale/dispatch.py on benchmarks/fake_replicas.py): every
row taken in exactly once, fast replicas take more, a lost replica's rows kept and the rest
re-queued elsewhere, duplicates dropped, a parcel that fails everywhere reported after the rest
is stored, silent and unstartable replicas killed after the timeout; parcels keep units whole."""
from __future__ import annotations

import queue
import time

import pytest

from benchmarks.fake_replicas import FakeBackend, Faults
from evalrun.scale.dispatch import Dispatcher, Limits
from evalrun.scale.ray_actor import stream
from evalrun.scale.units import Parcel, WorkUnit, pack_units, replica_parcels
from evalrun.tasks.base import PrefixGroup


def _parcels(sizes: list[int]) -> list[Parcel]:
    return [Parcel(f"s{i}", (f"s{i}",), tuple((f"s{i}", j) for j in range(n)), 10 * n) for i, n in enumerate(sizes)]


def _row(key: tuple) -> dict:
    return {"subject": key[0], "doc_id": key[1]}


def _key(row: dict) -> tuple:
    return row["subject"], row["doc_id"]


class ListIntake:
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.prompts: dict[str, str] = {}
        self.ticks = 0

    def add(self, rows, prompts) -> None:
        self.rows += rows
        self.prompts.update(prompts)

    def tick(self) -> None:
        self.ticks += 1


def _run(parcels, replicas=2, faults=None, batch_rows=2, **limits):
    backend = FakeBackend(_row, batch_rows, faults)
    intake, log = ListIntake(), []
    report = Dispatcher(backend, parcels, replicas, _key, intake, limits=Limits(**{"timeout": 5.0, **limits}),
                        clock=backend.clock, log=log.append).run()
    return report, intake, backend, log


def _assert_each_once(intake: ListIntake, parcels: list[Parcel], missing: tuple = ()) -> None:
    keys = [_key(r) for r in intake.rows]
    assert len(keys) == len(set(keys))
    assert set(keys) == {k for p in parcels for k in p.doc_keys} - set(missing)


def test_every_row_once_and_the_fast_replica_takes_more():
    parcels = _parcels([3] * 8)
    report, intake, backend, _ = _run(parcels, faults=Faults(slow={1: 4}))
    _assert_each_once(intake, parcels)
    assert report.retries == [] and report.failed == [] and report.duplicates == 0 and report.rows == 24
    per_slot = [sum(1 for s, _, _ in backend.submitted if s == slot) for slot in (0, 1)]
    assert sum(per_slot) == 8 and per_slot[0] > per_slot[1] >= 1
    assert [(a["slot"], a["instance"], a["parcels"]) for a in report.actors] == [(0, 0, per_slot[0]),
                                                                                 (1, 0, per_slot[1])]
    assert report.stats[(0, 0)]["prompt_tokens"] == 3 * per_slot[0]


def test_a_lost_replica_keeps_its_rows_and_the_rest_goes_to_another():
    parcels = _parcels([6, 2, 2])
    report, intake, backend, log = _run(parcels, faults=Faults(die_after={(0, 0): 3}))
    _assert_each_once(intake, parcels)
    assert report.retries == [{"parcel": "s0", "units": ["s0"], "slot": 0, "instance": 0, "attempt": 1,
                               "error": "SIGKILL (fake)", "rows_kept": 3, "docs_left": 3, "outcome": "re-queued"}]
    assert (1, 0, (("s0", 3), ("s0", 4), ("s0", 5))) in backend.submitted      # only what was missing, elsewhere
    assert [(a["slot"], a["instance"]) for a in report.actors] == [(0, 0), (1, 0), (0, 1)]
    assert report.actors[0]["end"] == "lost: SIGKILL (fake)" and report.actors[0]["rows"] == 3
    assert any("replica 0 lost (SIGKILL (fake)); restarting it (1 of 3 restarts)" in line for line in log)
    assert report.failed == []


def test_one_replica_gets_a_second_try_on_its_restarted_actor():
    parcels = _parcels([4, 4])
    report, intake, backend, _ = _run(parcels, replicas=1, faults=Faults(die_after={(0, 0): 1}))
    _assert_each_once(intake, parcels)
    assert [r["outcome"] for r in report.retries] == ["re-queued"]
    assert backend.submitted[1] == (0, 1, (("s0", 1), ("s0", 2), ("s0", 3)))


def test_rows_sent_twice_are_dropped_and_counted():
    parcels = _parcels([4, 4, 4])
    report, intake, _, _ = _run(parcels, faults=Faults(repeat={(1, 0)}))
    _assert_each_once(intake, parcels)
    assert report.duplicates == report.actors[1]["rows"] > 0


def test_a_parcel_failing_everywhere_is_reported_and_the_rest_stored():
    parcels = _parcels([3, 3, 3])
    report, intake, _, _ = _run(parcels, faults=Faults(fail_docs=frozenset({("s1", 1)})))
    _assert_each_once(intake, parcels, missing=(("s1", 1), ("s1", 2)))
    assert [(r["attempt"], r["outcome"]) for r in report.retries] == [(1, "re-queued"), (2, "given up")]
    assert {r["slot"] for r in report.retries} == {0, 1}                    # the retry went to the other one
    assert report.failed == [{"parcel": "s1", "units": ["s1"], "docs": 2, "attempts": 2,
                              "error": "ValueError: a document that fails everywhere"}]


def test_a_silent_replica_is_killed_after_the_timeout_and_restarted():
    parcels = _parcels([2, 2, 2])
    report, intake, backend, _ = _run(parcels, faults=Faults(silent={(0, 0)}), timeout=5.0)
    _assert_each_once(intake, parcels)
    assert (0, 0) in backend.killed
    assert report.retries[0]["error"] == "sent nothing for 5 s while running parcel s0; killed as hung"
    assert backend.now < 20                                     # no wait longer than the timeout


def test_replicas_that_never_start_are_killed_and_restarted():
    parcels = _parcels([2, 2])
    report, intake, backend, _ = _run(parcels, faults=Faults(no_start={(0, 0), (1, 0)}), timeout=5.0)
    _assert_each_once(intake, parcels)
    assert backend.killed == [(0, 0), (1, 0)]
    assert report.actors[0]["end"].startswith("lost: did not start within 5 s")
    assert report.retries == [] and 5 <= backend.now < 10


def test_replicas_that_cannot_start_end_the_run_with_every_parcel_failed():
    parcels = _parcels([2, 2])
    faults = Faults(start_error={0: "BadInput: no sandbox here", 1: "BadInput: no sandbox here"})
    report, intake, _, _ = _run(parcels, faults=faults)
    assert intake.rows == []
    assert [f["parcel"] for f in report.failed] == ["s0", "s1"]
    assert report.failed[0]["error"] == "no replica is left (replica 1 could not start: BadInput: no sandbox here)"


def test_a_slot_out_of_restarts_retires_and_the_others_finish():
    parcels = _parcels([2] * 6)
    report, intake, _, log = _run(parcels, faults=Faults(die_after={(0, 0): 1, (0, 1): 1}), max_restarts=1)
    _assert_each_once(intake, parcels)
    assert report.actors[-1]["slot"] == 0 and report.actors[-1]["end"].startswith("lost 2 times")
    assert any(line.startswith("replica 0 retired") for line in log)
    assert report.failed == []


def test_events_of_a_killed_submission_are_ignored():
    parcels = _parcels([2, 2])
    backend = FakeBackend(_row, 2)
    intake = ListIntake()
    dispatcher = Dispatcher(backend, parcels, 1, _key, intake, clock=backend.clock, log=lambda line: None)
    from evalrun.scale.dispatch import Rows
    dispatcher._handle(Rows(0, 99, [_row(("s0", 0))]))          # no submission has token 99
    assert intake.rows == []
    dispatcher.run()
    _assert_each_once(intake, parcels)


def test_pack_units_keeps_units_whole_and_consecutive():
    units = [WorkUnit(k, k, ((k, 0),), est) for k, est in (("a", 5), ("b", 4), ("c", 9), ("d", 1), ("e", 2))]
    parcels = pack_units(units, 10)
    assert [(p.key, p.units, p.est_tokens) for p in parcels] == [("a+1", ("a", "b"), 9), ("c+1", ("c", "d"), 10),
                                                                 ("e", ("e",), 2)]
    assert parcels[0].doc_keys == (("a", 0), ("b", 0))
    assert parcels[0].without({("a", 0)}).doc_keys == (("b", 0),)


class _Groups:
    def __init__(self, groups):
        self.groups = groups

    def prefix_groups(self):
        return self.groups


def test_replica_parcels_are_largest_first_under_the_cap():
    groups = [PrefixGroup(f"p{i}", tuple((f"p{i}", j) for j in range(n)), 10, (5,) * n) for i, n in
              enumerate([1, 8, 1, 1, 2])]
    parcels, cap = replica_parcels(_Groups(groups), 2)
    assert cap == -(-sum(g.est_tokens for g in groups) // 8)
    assert [p.est_tokens for p in parcels] == sorted((p.est_tokens for p in parcels), reverse=True)
    assert sorted(k for p in parcels for k in p.doc_keys) == sorted(k for g in groups for k in g.doc_keys)
    assert all(len({k[0] for k in p.doc_keys}) == len(p.units) for p in parcels)     # HumanEval-like: whole


def _messages(items, **kw):
    q: queue.Queue = queue.Queue()
    for item in items:
        q.put(item)
    return list(stream(q, **{"batch_rows": 2, "batch_seconds": 0.05, "heartbeat_seconds": 0.05, **kw}))


def test_stream_batches_rows_and_ends_with_done_or_error():
    got = _messages([("prompts", {"h": "p"}), ("row", 1), ("row", 2), ("row", 3), ("done", {"n": 3})])
    assert got == [{"rows": [1, 2], "prompts": {"h": "p"}}, {"rows": [3], "prompts": {}, "done": {"n": 3}}]
    got = _messages([("row", 1), ("error", "ValueError: x")])
    assert got == [{"rows": [1], "prompts": {}, "error": "ValueError: x"}]


def test_stream_sends_what_it_has_after_batch_seconds_and_heartbeats_when_idle():
    q: queue.Queue = queue.Queue()
    q.put(("row", 1))
    out = stream(q, batch_rows=10, batch_seconds=0.05, heartbeat_seconds=0.05)
    t0 = time.monotonic()
    assert next(out) == {"rows": [1], "prompts": {}}
    assert next(out) == {"rows": [], "prompts": {}}             # nothing for heartbeat_seconds
    assert time.monotonic() - t0 < 2
    q.put(("done", {}))
    assert next(out) == {"rows": [], "prompts": {}, "done": {}}
    with pytest.raises(StopIteration):
        next(out)
