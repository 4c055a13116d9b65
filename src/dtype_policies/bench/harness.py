"""The one timer of the benchmarks, and what a result records about the machine.

`measure_interleaved` times every variant of a table in turn, round after
round, so that drift of a shared machine hits all variants alike;
`paired_ratio` is the median over rounds of the ratio of two variants'
per-round medians (each table states its ratios against its reference
variant). Every benchmark in `dtype_policies.bench` and `benchmarks/` times
through these two functions.

Each round also records the share of the machine other processes took
(`contention`); inside `retiming_contended_rounds` (the suite's runner) a
round above `contention.QUIET_SHARE` waits for a quiet machine and is timed
again, and every table's contention is logged so that the report can say
which figures were measured on a busy machine.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from dtype_policies._cpu import hardware_flags, processor
from dtype_policies._json import strict
from dtype_policies.bench import contention


class Timed(float):
    """Seconds measured by a variant itself (e.g. per generated token); a
    variant that returns one is timed by it instead of by its wall-clock call."""


class TokenClock:
    """A `generate` streamer that records when each new token is produced
    (`times`; the prompt, passed first, is not a new token)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: object) -> None:
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@dataclass
class Result:
    workload: str
    variant: str
    median_ms: float
    spread_ms: float  # interquartile range
    samples: int
    note: str = ""
    extra: dict = field(default_factory=dict)
    machine: dict = field(default_factory=dict)  # `row_machine`: where it was measured


def time_call(fn: Callable[[], object]) -> tuple[float, object]:
    """Seconds of one call of `fn` (or the `Timed` it returns), and what it returned.

    >>> time_call(lambda: Timed(0.5))[0]
    0.5
    """
    start = time.perf_counter()
    out = fn()
    elapsed = time.perf_counter() - start
    return (float(out) if isinstance(out, Timed) else elapsed), out


def _calls_per_sample(fn: Callable[[], object], min_sample_s: float) -> int:
    """How many calls of `fn` make a sample of at least `min_sample_s` (1 to 200)."""
    if min_sample_s <= 0:
        return 1
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    return max(1, min(200, int(min_sample_s / max(once, 1e-7))))


class Samples(dict):
    """Per variant, the samples (seconds per call) of each round; and per
    round, the share of the machine other processes took (`others_share`,
    `None` where unreadable) and how many rounds were timed again. Where no
    round was long enough to read on its own, `table_share` is the share
    over all of them (`None` otherwise, or where unreadable)."""

    others_share: list[float | None]
    retimed: int
    table_share: float | None = None

    def contention_note(self) -> str:
        """ "" on a quiet machine, else what other processes took.

        >>> samples = Samples({"a": [[1.0], [1.0]]})
        >>> samples.others_share, samples.retimed = [0.01, 0.31], 1
        >>> print(samples.contention_note())  # doctest: +NORMALIZE_WHITESPACE
        contended: other processes took up to 31% of the CPU in 1 of 2 rounds
        (1 round timed again)
        """
        busy = [s for s in self.others_share if s is not None and s >= contention.QUIET_SHARE]
        if self.others_share and all(s is None for s in self.others_share):
            if self.table_share is None:
                return "load unknown: /proc/stat unreadable or rounds too short to read it"
            if self.table_share < contention.QUIET_SHARE:
                return ""
            return (
                f"contended: other processes took {self.table_share:.0%} of the CPU over "
                f"the table's {len(self.others_share)} rounds (each too short to read alone)"
            )
        if not busy:
            return ""
        retimed = f" ({self.retimed} round{'s' * (self.retimed != 1)} timed again)"
        return (
            f"contended: other processes took up to {max(busy):.0%} of the CPU in "
            f"{len(busy)} of {len(self.others_share)} rounds" + (retimed if self.retimed else "")
        )


@dataclass
class _Retiming:
    retries: int
    max_wait_s: float
    log: list[tuple[str, Samples]]


_RETIMING: contextvars.ContextVar[_Retiming | None] = contextvars.ContextVar(
    "dtype_policies_bench_retiming", default=None
)


@contextlib.contextmanager
def retiming_contended_rounds(
    retries: int = 2, max_wait_s: float = 60.0
) -> Iterator[list[tuple[str, Samples]]]:
    """Within it, `measure_interleaved` times a round again (up to `retries`
    times, after waiting up to `max_wait_s` for a quiet machine) when other
    processes took more than `contention.QUIET_SHARE` of the machine, and
    keeps the least contended attempt; once a wait ends on a busy machine,
    no round of the run waits again (it is timed once more, at most). Yields
    the log: (label, samples) of every table timed.

    >>> with retiming_contended_rounds(retries=0) as log:
    ...     _ = measure_interleaved({"a": lambda: Timed(1.0)}, warmup=0, label="t")
    >>> [(label, list(samples)) for label, samples in log]
    [('t', ['a'])]
    """
    token = _RETIMING.set(_Retiming(retries, max_wait_s, []))
    try:
        yield _RETIMING.get().log  # type: ignore[union-attr]
    finally:
        _RETIMING.reset(token)


# Pause before each variant's samples in a round: thread pools that
# spin-wait after a call (ONNX Runtime's by default, OpenMP's, TBB's) go to
# sleep, so that no variant is timed beside the previous one's spinning threads.
SETTLE_S = 0.05
# A variant whose call takes at most this long gets one untimed call after the
# pause, so that its samples are of back-to-back calls as a user makes them.
_REWARM_S = 0.2


def _time_round(
    variants: dict[str, Callable[[], object]],
    calls: dict[str, int],
    per_round: int,
    rewarm: frozenset[str] = frozenset(),
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}
    for name, fn in variants.items():
        times[name] = []
        if len(variants) > 1:
            time.sleep(SETTLE_S)
            if name in rewarm:
                fn()
        for _ in range(per_round):
            if calls[name] == 1:
                times[name].append(time_call(fn)[0])
                continue
            start = time.perf_counter()
            for _ in range(calls[name]):
                out = fn()
            elapsed = (time.perf_counter() - start) / calls[name]
            times[name].append(float(out) if isinstance(out, Timed) else elapsed)
    return times


def measure_interleaved(
    variants: dict[str, Callable[[], object]],
    *,
    warmup: int = 3,
    repeats: int = 15,
    rounds: int = 3,
    min_sample_s: float = 0.0,
    label: str = "",
) -> Samples:
    """Times every variant in turn, `rounds` times over, so that drift of the
    machine (thermal, other load) hits all variants alike. Returns, per
    variant, the samples (seconds per call) of each round, with the share of
    the machine other processes took in each round (see `Samples`).

    A sample is one call, or, with `min_sample_s`, as many calls as take that
    long (counted once per variant after the warm-up; for microsecond
    kernels). A variant returning `Timed` is timed by that value instead.
    With more than one variant, before each variant's samples in a round the
    timer pauses `SETTLE_S` (the previous variant's spinning threads go idle)
    and, for a variant whose warm-up call took at most `_REWARM_S` of wall
    time, makes one untimed call.

    >>> samples = measure_interleaved({"a": lambda: Timed(2.0)}, warmup=0, repeats=4, rounds=2)
    >>> samples, paired_ratio({"b": [[4.0], [2.0]], "a": [[2.0], [2.0]]}, "b", "a")
    ({'a': [[2.0, 2.0], [2.0, 2.0]]}, 1.5)
    """
    rewarm = set()
    for name, fn in variants.items():
        for _ in range(warmup):
            start = time.perf_counter()  # the call's own time, not a `Timed` it returns
            fn()
            if time.perf_counter() - start <= _REWARM_S:
                rewarm.add(name)
    calls = {name: _calls_per_sample(fn, min_sample_s) for name, fn in variants.items()}
    retiming = _RETIMING.get()
    samples = Samples({name: [] for name in variants})
    samples.others_share, samples.retimed = [], 0
    per_round = max(1, repeats // rounds)
    whole_table = contention.LoadWindow()
    for _ in range(rounds):
        window = contention.LoadWindow()
        times = _time_round(variants, calls, per_round, frozenset(rewarm))
        share = window.others_share()
        for _ in range(retiming.retries if retiming else 0):
            if share is None or share < contention.QUIET_SHARE:
                break
            quiet = contention.wait_until_quiet(retiming.max_wait_s)  # type: ignore[union-attr]
            samples.retimed += 1
            window.restart()
            again = _time_round(variants, calls, per_round, frozenset(rewarm))
            again_share = window.others_share()
            if again_share is not None and again_share < share:
                times, share = again, again_share
            if not quiet:  # busy for good: no more waiting in this run (a minute each)
                retiming.retries = 0  # type: ignore[union-attr]
                break
        for name in variants:
            samples[name].append(times[name])
        samples.others_share.append(share)
    if all(share is None for share in samples.others_share):
        samples.table_share = whole_table.others_share()
    if retiming is not None:
        retiming.log.append((label, samples))
    return samples


def paired_ratio(samples: dict[str, list[list[float]]], baseline: str, variant: str) -> float:
    """baseline time / variant time, as the median over rounds of the ratio of
    the two rounds' medians (robust to drift between rounds)."""
    ratios = [
        statistics.median(b) / statistics.median(v)
        for b, v in zip(samples[baseline], samples[variant])
    ]
    return statistics.median(ratios)


def judged(
    value: float, bound: float, at_least: bool, digits: int = 2, percent: bool = False
) -> str:
    """`value` as a target's table shows it: with `digits` decimals, or as
    many more as keep the shown figure on the same side of `bound` as the
    value itself (a ratio of 0.7953 against 0.8 reads `0.795x`, not a
    `0.80x` beside "not met"). `percent`: `value` is a ratio to a
    reference, shown as its change in percent.

    >>> judged(0.7953, 0.8, at_least=True), judged(0.8123, 0.8, at_least=True)
    ('0.795x', '0.81x')
    >>> judged(1.0604, 1.06, at_least=False, digits=1, percent=True)
    '+6.04%'
    >>> judged(float("nan"), 0.8, at_least=True)
    'not measured (nan)'
    """
    if not math.isfinite(value):
        return f"not measured ({value})"
    met = value >= bound if at_least else value <= bound
    for places in range(digits, 17):
        shown = round(value - 1, places + 2) + 1 if percent else round(value, places)
        if (shown >= bound if at_least else shown <= bound) == met:
            break
    else:  # closer to the bound than any shown figure: its exact value
        return f"{value!r} ({'' if met else 'not '}{'above' if at_least else 'below'} {bound!r})"
    if percent:
        return f"{(value - 1) * 100:+.{places}f}%"
    return f"{value:.{places}f}x"


def summarize(
    workload: str,
    samples: dict[str, list[list[float]]],
    notes: dict[str, str] | None = None,
    machine: dict[str, str] | None = None,
) -> list[Result]:
    results = []
    for name, per_round in samples.items():
        values = [t for round_times in per_round for t in round_times]
        quartiles = statistics.quantiles(values, n=4) if len(values) >= 4 else [0, 0, 0]
        results.append(
            Result(
                workload=workload,
                variant=name,
                median_ms=statistics.median(values) * 1e3,
                spread_ms=(quartiles[2] - quartiles[0]) * 1e3,
                samples=len(values),
                note=(notes or {}).get(name, ""),
                machine=dict(machine or {}),
            )
        )
    return results


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


_REPORTED_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vbmi",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_int8",
)


def cpu_flags() -> str:
    """The hardware flags that matter to the kernels (as the processor reports
    them, before any cap)."""
    flags = hardware_flags()
    return " ".join(flag for flag in _REPORTED_FLAGS if flag in flags)


def machine_info() -> dict[str, str]:
    """What a result records about where it was measured."""
    return {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_model(),
        "cpu_class": processor().name,
        "cpu_flags": cpu_flags(),
        "cores": str(os.cpu_count()),
        "threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_features": processor().describe(),
        "python": platform.python_version(),
    }


ROW_MACHINE_KEYS = ("cpu_class", "cpu_flags", "threads")


def row_machine(info: dict[str, str]) -> dict[str, str]:
    """What every result row records of `machine_info`: the CPU class, its
    flags and the thread count, so that a table names where it was measured.

    >>> row_machine({"cpu_class": "avx512", "cpu_flags": "avx2", "threads": "1", "cpu": "x"})
    {'cpu_class': 'avx512', 'cpu_flags': 'avx2', 'threads': '1'}
    """
    return {key: info[key] for key in ROW_MACHINE_KEYS}


def peak_rss_mb_of(code: str) -> float | None:
    """Peak resident memory (MiB) of a fresh Python process running `code`."""
    # VmHWM belongs to the process's own address space (ru_maxrss would carry
    # over the parent's peak through fork).
    script = (
        f"{code}\n"
        "peak = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
        "print('PEAK_RSS_KB', peak.split()[1])\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    for line in out.splitlines():
        if line.startswith("PEAK_RSS_KB"):
            return int(line.split()[1]) / 1024
    return None


def first_call_of(code: str, env: dict[str, str] | None = None) -> tuple[float, float] | str:
    """Runs `code` in a fresh Python process with a fresh inductor cache; the
    code defines `run` (a built variant, not yet called). Returns the wall time
    (seconds) of the first `run()` and the median of the next three, or the
    error text when the process fails."""
    import tempfile

    script = (
        f"{code}\n"
        "import statistics, time\n"
        "start = time.perf_counter(); run(); first = time.perf_counter() - start\n"
        "later = []\n"
        "for _ in range(3):\n"
        "    start = time.perf_counter(); run(); later.append(time.perf_counter() - start)\n"
        "print('FIRST_CALL_S', first, statistics.median(later))\n"
    )
    with tempfile.TemporaryDirectory() as cache:
        environ = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, **(env or {})}
        try:
            done = subprocess.run(
                [sys.executable, "-c", script],
                capture_output=True,
                text=True,
                timeout=900,
                env=environ,
            )
        except (subprocess.SubprocessError, OSError) as e:
            return f"{type(e).__name__}"
    for line in done.stdout.splitlines():
        if line.startswith("FIRST_CALL_S"):
            first, later = line.split()[1:]
            return float(first), float(later)
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return lines[-1][:160] if lines else f"exit code {done.returncode}"


def write_json(path: str, info: dict, results: list[Result], targets: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump(
            strict({"machine": info, "results": [asdict(r) for r in results], "targets": targets}),
            f,
            indent=2,
            allow_nan=False,  # a failed variant's NaN is null: strict parsers read the file
        )
