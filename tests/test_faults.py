# tests/test_faults.py - zz/faults.py against the shared scenarios in tests/vectors/faults.txt
# plus randomized properties (single faulty agreement replica, no client input, agreeing reports).
from __future__ import annotations

import ctypes
import inspect
import itertools
import random
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from zz import faults
from zz.faults import Entry, FaultStatement, Kind

VECTORS = Path(__file__).parent / "vectors" / "faults.txt"


@dataclass
class Case:
    name: str
    source: str = ""
    f: int = 0
    g: int = 0
    service: str = ""
    seq: int = 0
    awake: list[int] = field(default_factory=list)
    sleeping: list[int] = field(default_factory=list)
    rows: list[FaultStatement] = field(default_factory=list)
    wake: tuple[bool, str, list[int]] | None = None
    reports: dict[int, Entry] | None = None
    decided: str | None = None
    convict: list[int] = field(default_factory=list)
    stay: list[int] = field(default_factory=list)
    sleep: list[int] = field(default_factory=list)
    # A TR example: what every agreement replica saw from each awake replica; `rows` are
    # then the columns without a certificate (fault statements), in signer order.
    matrix: dict[int, list[Entry]] = field(default_factory=dict)
    woken_report: Entry | None = None
    shutdown: list[int] | None = None


def parse_entry(tok: str) -> Entry:
    if tok == "-":
        return Entry.missing()
    if tok.endswith("'"):
        return Entry.late(tok[:-1].encode())
    return Entry.ontime(tok.encode())


def _ids(fields: list[str]) -> list[int]:
    return [int(x) for x in fields]


def parse(text: str) -> tuple[list[Case], list[tuple[float, float, float, float, float]]]:
    cases: list[Case] = []
    timers: list[tuple[float, float, float, float, float]] = []
    cur: Case | None = None
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, *rest = line.split(" ")
        if key == "timer":
            t1, k, lo, hi, want = (float(x) for x in rest)
            timers.append((t1, k, lo, hi, want))
        elif key == "case":
            assert cur is None, f"case {rest} inside {cur and cur.name}"
            cur = Case(rest[0])
        elif key == "end":
            assert cur is not None
            if cur.matrix:
                cur.rows = [r for r in _columns(cur) if faults.is_fault_row(r.entries, cur.f)]
            cases.append(cur)
            cur = None
        else:
            assert cur is not None, f"{key} outside a case"
            _apply(cur, key, rest)
    assert cur is None, "missing end"
    return cases, timers


def _apply(c: Case, key: str, rest: list[str]) -> None:
    if key == "source":
        c.source = " ".join(rest)
    elif key == "params":
        kv = dict(x.split("=", 1) for x in rest)
        c.f, c.g, c.service, c.seq = int(kv["f"]), int(kv["g"]), kv["service"], int(kv["seq"])
    elif key == "awake":
        c.awake = _ids(rest)
    elif key == "sleeping":
        c.sleeping = _ids(rest)
    elif key == "row":
        signer, seq, cells = int(rest[0]), c.seq, rest[1:]
        if cells and cells[0].startswith("seq="):
            seq, cells = int(cells[0][4:]), cells[1:]
        entries = tuple(parse_entry(t) for t in cells)
        c.rows.append(FaultStatement(signer, c.service, seq, tuple(c.awake), entries))
    elif key == "expect-wake":
        c.wake = (rest[0] == "yes", rest[1], _ids(rest[2:]))
    elif key == "report":
        c.reports = {int(j): parse_entry(e) for j, e in (x.split("=", 1) for x in rest)}
    elif key == "expect-decided":
        c.decided = None if rest[0] == "-" else rest[0]
    elif key == "expect-convict":
        c.convict = _ids(rest)
    elif key == "expect-stay":
        c.stay = _ids(rest)
    elif key == "expect-sleep":
        c.sleep = _ids(rest)
    elif key == "matrix":
        c.matrix[int(rest[0])] = [parse_entry(t) for t in rest[1:]]
    elif key == "woken-report":
        c.woken_report = parse_entry(rest[0])
    elif key == "expect-shutdown":
        c.shutdown = _ids(rest)
    else:
        raise AssertionError(f"unknown keyword {key!r}")


def _columns(c: Case) -> list[FaultStatement]:
    """Agreement replica i's row of a TR matrix: column i, over the awake replicas."""
    assert sorted(c.matrix) == c.awake
    width = {len(cells) for cells in c.matrix.values()}
    assert width == {3 * c.g + 1}, f"{c.name}: a matrix has a column per agreement replica"
    return [
        FaultStatement(i, c.service, c.seq, tuple(c.awake), tuple(c.matrix[j][i] for j in c.awake))
        for i in range(3 * c.g + 1)
    ]


CASES, TIMERS = parse(VECTORS.read_text())


def test_vector_file_has_the_tr_examples() -> None:
    # The eleven worked examples of TR §9.1.1: four of Lemma 2A and seven of Lemma 2.
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))
    assert sum(n.startswith("tr-l2a-") for n in names) == 4
    assert sum(n.startswith("tr-l2-") for n in names) == 7
    assert all(c.source for c in CASES)
    assert all(c.source.startswith("tr ") == bool(c.matrix) for c in CASES)


def _shutdown_votes(c: Case, rows: list[FaultStatement], woken: tuple[int, ...]) -> Counter:
    """What each agreement replica votes once the woken replicas reported: resolve over the
    evidence with its own column of the matrix as its view of the reports."""
    votes: Counter = Counter()
    for i in range(3 * c.g + 1):
        mine = {j: c.matrix[j][i] for j in c.awake}
        mine |= {j: c.woken_report or parse_entry("p") for j in woken}
        r = faults.resolve(
            rows, mine, f=c.f, g=c.g, service=c.service, seq=c.seq, awake=c.awake, woken=woken
        )
        votes[(r.decided, r.convict, r.stay_active, r.to_sleep)] += 1
    return votes


@pytest.mark.parametrize("case", [c for c in CASES if c.matrix], ids=lambda c: c.name)
def test_tr_example(case: Case) -> None:
    """The TR's verdict for every g+1 of the fault rows (any of them may reach a replica
    first): wake-up or not, and the shutdown g+1 agreement replicas vote for."""
    assert case.wake is not None
    justified, reason, wake = case.wake
    kw = dict(f=case.f, g=case.g, service=case.service, seq=case.seq, awake=case.awake)
    subsets = list(itertools.combinations(case.rows, case.g + 1)) or [tuple(case.rows)]
    for rows in subsets:
        d = faults.evaluate_evidence(list(rows), sleeping=case.sleeping, **kw)
        assert (d.justified, d.reason, list(d.wake)) == (justified, reason, wake), rows
        if not d.justified:
            assert case.shutdown is None
            continue
        votes = _shutdown_votes(case, list(rows), d.wake)
        certified = [body for body, n in votes.items() if n >= case.g + 1]
        assert len(certified) == 1, votes
        assert list(certified[0][1]) == case.shutdown, votes


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_vector(case: Case) -> None:
    kw = dict(f=case.f, g=case.g, service=case.service, seq=case.seq, awake=case.awake)
    d = faults.evaluate_evidence(case.rows, sleeping=case.sleeping, **kw)
    assert case.wake is not None
    justified, reason, wake = case.wake
    assert (d.justified, d.reason, list(d.wake)) == (justified, reason, wake)
    if case.reports is None:
        return
    r = faults.resolve(case.rows, case.reports, woken=d.wake, **kw)
    assert r.decided == (None if case.decided is None else case.decided.encode())
    assert list(r.convict) == case.convict
    assert list(r.stay_active) == case.stay
    assert list(r.to_sleep) == case.sleep
    if r.decided is not None:
        assert r.shortfall == case.f + 1 - len(case.stay)
        assert r.provision == len(case.convict)


@pytest.mark.parametrize("t1,k,lo,hi,want", TIMERS)
def test_timer_vector(t1: float, k: float, lo: float, hi: float, want: float) -> None:
    assert faults.timer_duration(t1, k, lo, hi) == want


def test_late_is_relative_to_first_report() -> None:
    # commit at 0, first report at 100 ms, K=3: the deadline is 100 + 300.
    assert not faults.is_late(400, 0, 100, 3, 50, 1000)
    assert faults.is_late(401, 0, 100, 3, 50, 1000)
    # A faulty replica answering at once only buys the floor, not a zero timer.
    assert not faults.is_late(50, 0, 0, 3, 50, 1000)


def test_timer_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        faults.timer_duration(1, 0.5, 0, 10)
    with pytest.raises(ValueError):
        faults.timer_duration(1, 2, 10, 5)


def test_late_entry_never_matches_ontime() -> None:
    rows = [Entry.ontime(b"a"), Entry.late(b"a")]
    assert faults.is_fault_row(rows, f=1)
    assert faults.certified_digest([Entry.ontime(b"a"), Entry.ontime(b"a")], f=1) == b"a"
    with pytest.raises(ValueError):
        Entry(Kind.LATE, None)


def test_resolve_refuses_rejected_evidence() -> None:
    row = FaultStatement(0, "web", 7, (0, 1), (Entry.ontime(b"a"), Entry.ontime(b"a")))
    with pytest.raises(ValueError, match="not-a-fault"):
        faults.resolve([row], {}, f=1, g=1, service="web", seq=7, awake=[0, 1], woken=[2])


# ---- randomized properties ------------------------------------------------------------------

DIGESTS = [b"a", b"b", b"c"]


def _random_entry(rng: random.Random) -> Entry:
    kind = rng.choice(list(Kind))
    return Entry(kind, None if kind is Kind.NONE else rng.choice(DIGESTS))


def _params(rng: random.Random) -> tuple[int, int, list[int], list[int]]:
    f, g = rng.randint(1, 3), rng.randint(1, 3)
    awake = list(range(f + 1))
    return f, g, awake, list(range(f + 1, 2 * f + 1))


def _stmt(signer: int, awake: list[int], entries: list[Entry]) -> FaultStatement:
    return FaultStatement(signer, "web", 7, tuple(awake), tuple(entries))


@pytest.mark.parametrize("seed", range(300))
def test_single_agreement_replica_never_wakes(seed: int) -> None:
    rng = random.Random(seed)
    f, g, awake, sleeping = _params(rng)
    stmt = _stmt(rng.randint(0, 3 * g), awake, [_random_entry(rng) for _ in awake])
    d = faults.evaluate_evidence(
        [stmt], f=f, g=g, service="web", seq=7, awake=awake, sleeping=sleeping
    )
    assert not d.justified and d.wake == ()


@pytest.mark.parametrize("seed", range(100))
def test_agreeing_ontime_reports_never_wake(seed: int) -> None:
    rng = random.Random(seed)
    f, g, awake, sleeping = _params(rng)
    digest = rng.choice(DIGESTS)
    signers = rng.sample(range(3 * g + 1), rng.randint(1, 3 * g + 1))
    rows = [_stmt(s, awake, [Entry.ontime(digest)] * len(awake)) for s in signers]
    d = faults.evaluate_evidence(
        rows, f=f, g=g, service="web", seq=7, awake=awake, sleeping=sleeping
    )
    assert not d.justified and d.reason == "not-a-fault"


def test_no_client_input() -> None:
    # The decision may depend on statements, f, g and replica ids only (docs/design.md §1).
    allowed = {"statements", "reports", "f", "g", "service", "seq", "awake", "sleeping", "woken"}
    for fn in (faults.evaluate_evidence, faults.resolve):
        assert set(inspect.signature(fn).parameters) <= allowed, fn.__name__
    fields = set(FaultStatement.__dataclass_fields__)
    assert fields == {"signer", "service", "seq", "replicas", "entries"}


def _scenario(rng: random.Random):
    """Correct agreement replicas see correct execution replicas report D (maybe late);
    faulty execution replicas and faulty agreement replicas (<= f, <= g) do anything."""
    f, g, awake, sleeping = _params(rng)
    truth = rng.choice(DIGESTS)
    bad_exec = set(rng.sample(awake, rng.randint(0, f)))
    bad_agree = set(rng.sample(range(3 * g + 1), rng.randint(0, g)))
    slow = {j for j in awake if j not in bad_exec and rng.random() < 0.15}
    rows, timely_somewhere_late = [], set()
    for i in range(3 * g + 1):
        if i in bad_agree:
            entries = [_random_entry(rng) for _ in awake]
        else:
            entries = []
            for j in awake:
                if j in bad_exec:
                    entries.append(_random_entry(rng))
                elif j in slow and rng.random() < 0.5:
                    entries.append(rng.choice([Entry.late(truth), Entry.missing()]))
                    timely_somewhere_late.add(j)
                else:
                    entries.append(Entry.ontime(truth))
        if faults.is_fault_row(entries, f):
            rows.append(_stmt(i, awake, entries))
    rng.shuffle(rows)
    rows = rows[: rng.randint(0, len(rows))]
    return f, g, awake, sleeping, truth, bad_exec, timely_somewhere_late, rows


@pytest.mark.parametrize("seed", range(1500))
def test_wakeups_convict_and_spare_timely_correct_replicas(seed: int) -> None:
    rng = random.Random(seed)
    f, g, awake, sleeping, truth, bad_exec, late_at_correct, rows = _scenario(rng)
    kw = dict(f=f, g=g, service="web", seq=7, awake=awake)
    d = faults.evaluate_evidence(rows, sleeping=sleeping, **kw)
    assert d == faults.evaluate_evidence(list(reversed(rows)), sleeping=sleeping, **kw)
    if not d.justified:
        assert d.reason in {"too-few-signers", "not-convictable"}
        return
    assert 1 <= len(d.wake) <= f and set(d.wake) <= set(sleeping)
    reports = {j: (_random_entry(rng) if j in bad_exec else Entry.ontime(truth)) for j in awake}
    reports |= {j: Entry.ontime(truth) for j in d.wake}
    r = faults.resolve(rows, reports, woken=d.wake, **kw)
    assert r.decided in (None, truth)
    if r.decided is None:
        return
    assert r.convict, "a justified wake-up must convict someone (Definition 1)"
    # Only a faulty replica, or a correct one a correct agreement replica saw late, is convicted.
    assert set(r.convict) <= bad_exec | late_at_correct
    assert len(r.stay_active) + r.shortfall == f + 1
    assert not set(r.stay_active) & set(r.convict)


@pytest.mark.parametrize("seed", range(400))
def test_convictable_means_someone_is_convicted_whatever_is_correct(seed: int) -> None:
    # Definition 1 as a property: for every digest that could turn out correct
    # (any reported one, or one nobody reported), resolution convicts somebody.
    rng = random.Random(seed)
    f, g, awake, sleeping = _params(rng)
    signers = rng.sample(range(3 * g + 1), rng.randint(g + 1, 3 * g + 1))
    rows = [_stmt(s, awake, [_random_entry(rng) for _ in awake]) for s in signers]
    rows = [r for r in rows if faults.is_fault_row(r.entries, f)]
    kw = dict(f=f, g=g, service="web", seq=7, awake=awake)
    d = faults.evaluate_evidence(rows, sleeping=sleeping, **kw)
    if not d.justified:
        return
    for truth in [*DIGESTS, b"unseen"]:
        reports = {j: Entry.ontime(truth) for j in [*awake, *d.wake]}
        r = faults.resolve(rows, reports, woken=d.wake, **kw)
        assert r.decided == truth and r.convict, truth


# ---- the C port (agreement/src/faults.c) against this module, on random inputs ---------------
# The shared vectors pin the chosen scenarios; this pins everything else the two might differ
# on (reason order, wake choice with odd replica ids, resolve ordering, refusals).

REPO = Path(__file__).resolve().parent.parent
MAX_EXEC = 64


class _CEntry(ctypes.Structure):
    _fields_ = [("state", ctypes.c_uint8), ("dig", ctypes.c_uint8 * 32)]


class _CRow(ctypes.Structure):
    _fields_ = [
        ("signer", ctypes.c_uint32),
        ("seq", ctypes.c_uint64),
        ("n", ctypes.c_uint32),
        ("ids", ctypes.c_uint32 * MAX_EXEC),
        ("e", _CEntry * MAX_EXEC),
    ]


class _CReport(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint32), ("e", _CEntry)]


class _CResolution(ctypes.Structure):
    _fields_ = [
        ("decided", ctypes.c_int),
        ("digest", ctypes.c_uint8 * 32),
        ("convict", ctypes.c_uint32 * MAX_EXEC),
        ("n_convict", ctypes.c_uint32),
        ("stay", ctypes.c_uint32 * MAX_EXEC),
        ("n_stay", ctypes.c_uint32),
        ("sleep", ctypes.c_uint32 * MAX_EXEC),
        ("n_sleep", ctypes.c_uint32),
        ("shortfall", ctypes.c_uint32),
    ]


@pytest.fixture(scope="module")
def cfaults(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    so = tmp_path_factory.mktemp("cfaults") / "faults.so"
    src = REPO / "agreement" / "src"
    subprocess.run(
        [
            cc,
            "-std=c11",
            "-O1",
            "-shared",
            "-fPIC",
            f"-I{src}",
            "-o",
            str(so),
            str(src / "faults.c"),
        ],
        check=True,
    )
    lib = ctypes.CDLL(str(so))
    lib.zz_fault_reason_name.restype = ctypes.c_char_p
    return lib


_STATE = {Kind.NONE: 0, Kind.ONTIME: 1, Kind.LATE: 2}


def _c_entry(e: Entry) -> _CEntry:
    out = _CEntry(_STATE[e.kind])
    if e.digest is not None:
        out.dig[:] = list(e.digest)
    return out


def _u32s(ids: list[int]) -> ctypes.Array[ctypes.c_uint32]:
    return (ctypes.c_uint32 * max(1, len(ids)))(*ids)


def _c_rows(rows: list[FaultStatement]) -> ctypes.Array[_CRow]:
    arr = (_CRow * max(1, len(rows)))()
    for r, s in zip(arr, rows, strict=False):
        r.signer, r.seq, r.n = s.signer, s.seq, len(s.entries)
        for k, (j, e) in enumerate(zip(s.replicas, s.entries, strict=True)):
            r.ids[k], r.e[k] = j, _c_entry(e)
    return arr


def _random_case(rng: random.Random):
    g = rng.randint(0, 2)
    pool = rng.sample(range(12), rng.randint(1, 8))
    awake = sorted(pool[: rng.randint(1, len(pool))])
    f = rng.randint(0, len(awake) - 1 if rng.random() < 0.95 else 3)
    if rng.random() < 0.05:
        awake = list(reversed(awake))  # bad-params
    sleeping = [j for j in pool if j not in awake]
    if rng.random() < 0.1:
        sleeping.append(rng.choice(sleeping or [3]))  # duplicates as given
    digests = [bytes([c]) * 32 for c in b"abc"]

    def entry() -> Entry:
        kind = rng.choice([Kind.ONTIME, Kind.LATE, Kind.NONE])
        return Entry(kind, None if kind is Kind.NONE else rng.choice(digests))

    rows = []
    for _ in range(rng.randint(g, 3 * g + 2)):
        signer = rng.randint(0, 3 * g + (1 if rng.random() < 0.1 else 0))
        seq = 7 if rng.random() < 0.95 else 8
        ids = list(awake)
        if rng.random() < 0.05:
            ids = ids[:-1]  # shape
        rows.append(FaultStatement(signer, "web", seq, tuple(ids), tuple(entry() for _ in ids)))
    reports = {j: entry() for j in [*awake, *sleeping] if rng.random() < 0.8}
    return f, g, awake, sleeping, rows, reports


@pytest.mark.parametrize("seed", range(40))
def test_c_port_matches_python(cfaults: ctypes.CDLL, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(100):
        f, g, awake, sleeping, rows, reports = _random_case(rng)
        kw = dict(f=f, g=g, service="web", seq=7, awake=awake)
        try:
            d = faults.evaluate_evidence(rows, sleeping=sleeping, **kw)
        except ValueError:
            continue
        wake = (ctypes.c_uint32 * MAX_EXEC)()
        n_wake = ctypes.c_uint32(99)
        crows = _c_rows(rows)
        reason = cfaults.zz_fault_evaluate(
            crows, len(rows), f, g, ctypes.c_uint64(7), _u32s(awake), len(awake),
            _u32s(sleeping), len(sleeping), wake, ctypes.byref(n_wake),
        )  # fmt: skip
        assert cfaults.zz_fault_reason_name(reason).decode() == d.reason
        assert tuple(wake[: n_wake.value]) == d.wake
        if not d.justified:
            continue
        try:
            r = faults.resolve(rows, reports, woken=d.wake, **kw)
        except ValueError:
            r = None
        rep = (_CReport * max(1, len(reports)))()
        for cr, (j, e) in zip(rep, reports.items(), strict=False):
            cr.id, cr.e = j, _c_entry(e)
        out = _CResolution()
        rc = cfaults.zz_fault_resolve(
            crows, len(rows), f, g, _u32s(awake), len(awake), wake, n_wake,
            rep, len(reports), ctypes.byref(out),
        )  # fmt: skip
        assert (rc == -1) == (r is None)
        if r is None:
            continue
        assert bool(out.decided) == (r.decided is not None)
        if r.decided is None:
            continue
        assert bytes(out.digest) == r.decided
        assert tuple(out.convict[: out.n_convict]) == r.convict
        assert tuple(out.stay[: out.n_stay]) == r.stay_active
        assert tuple(out.sleep[: out.n_sleep]) == r.to_sleep
        assert out.shortfall == r.shortfall
