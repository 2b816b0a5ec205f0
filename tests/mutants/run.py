"""Mutation testing of the protocol: ``python -m tests.mutants.run [--quick] [NAME ...]``.

Each mutant in tests/mutants/catalogue.py is one small source edit that breaks one rule. It
is applied to a scratch copy of the tree (the real tree is only read), and only the
simulators run against it, seeds 0..N-1 one at a time (tests/mutants/worker.py): the raft
simulator (tests.sim.run) and then the compaction simulator (tests.sim.compaction); a
storage/ mutant only the latter, since the raft simulator never imports storage. A mutant is
caught by the first seed that fails (a broken invariant, a crash, or a seed that hangs past
--seed-limit-s); one that every seed lets through "survives", and the run exits 1: the safety
net has a hole. First the unmutated tree must pass the same seeds (else exit 2).

Bounds: --sim-seeds and --compaction-seeds cap the seeds, --timeout-s caps one mutant's time
(a mutant out of time counts as not caught), --jobs runs mutants in parallel. For a caught
mutant the runner prints the command that replays the failing seed on a mutated copy:
``python -m tests.mutants.run --replay NAME --command 'python -m tests.sim.run --seed 4'``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tests.mutants.catalogue import MUTANTS, QUICK, Mutant

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("raft", "storage", "app", "tests")
SIM_SEEDS = 1000
COMPACTION_SEEDS = 60
# One seed running this long hangs. An unmutated seed takes well under a second; the
# simulator's own event bound (MAX_EVENTS_PER_RUN) ends a livelock with a failure in ~30 s.
SEED_LIMIT_S = 120.0
TIMEOUT_S = 900.0  # one mutant, every simulator
POLL_S = 0.2

_stopping = threading.Event()  # set on Ctrl-C: every running simulator is killed


@dataclass(frozen=True, slots=True)
class Outcome:
    """How the simulators fared against one mutant (``None``: the unmutated tree)."""

    mutant: Mutant | None
    verdict: str  # "caught", "survived", "timeout" (out of time: not caught), "error" (broken mutant)
    by: str  # the simulator that caught it ("sim", "compaction"), else ""
    seed: int  # the seed that caught it, else -1
    detail: str  # the failure's first line: seed and invariant
    replay: str  # the simulator command that replays the failing seed
    seconds: float

    @property
    def caught(self) -> bool:
        return self.verdict == "caught"


# ---------------------------------------------------------------------- the scratch copy


def mutated_source(text: str, mutant: Mutant) -> str:
    """``text`` with the mutant's edit; its ``old`` text must occur exactly once, and the
    result must compile (a mutant is a protocol bug, not a syntax error)."""
    count = text.count(mutant.old)
    if count != 1:
        raise ValueError(f"mutant {mutant.name}: {mutant.path} holds its old text {count} times, not once")
    mutated = text.replace(mutant.old, mutant.new)
    compile(mutated, mutant.path, "exec")
    return mutated


def copy_tree(into: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, into / package, ignore=ignore)


def apply_mutant(root: Path, mutant: Mutant) -> None:
    """Edit ``mutant.path`` under ``root``, a scratch copy (never the real tree)."""
    if root.resolve() == ROOT or ROOT in root.resolve().parents:
        raise ValueError(f"refusing to mutate {root}: not a scratch copy")
    path = root / mutant.path
    path.write_text(mutated_source(path.read_text(), mutant))


def simulators_for(mutant: Mutant | None) -> tuple[str, ...]:
    """tests.sim.run imports raft only: it cannot see a storage/ mutant."""
    if mutant is not None and mutant.path.startswith("storage/"):
        return ("compaction",)
    return ("sim", "compaction")


# ---------------------------------------------------------------------- running the simulators


@dataclass(frozen=True, slots=True)
class _SimulatorRun:
    status: str  # "ok", "caught", "timeout", "error"
    seed: int = -1
    detail: str = ""
    replay: str = ""


def _simulate(root: Path, kind: str, seeds: int, seed_limit_s: float, deadline: float) -> _SimulatorRun:
    """Run ``kind`` over seeds 0..seeds-1 in ``root`` (tests/mutants/worker.py), watching
    how long each seed takes; kill the worker past ``seed_limit_s`` or ``deadline``."""
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
    out_path, err_path = root / f"{kind}.out", root / f"{kind}.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        process = subprocess.Popen([sys.executable, "-m", "tests.mutants.worker", kind, "0", str(seeds)],
                                   cwd=root, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
    seed, seed_started = -1, time.monotonic()
    killed = ""
    try:
        while process.poll() is None:
            time.sleep(POLL_S)
            lines = out_path.read_text().splitlines()
            current = next((int(line.split()[1]) for line in reversed(lines) if line.startswith("SEED ")), -1)
            now = time.monotonic()
            if current != seed:
                seed, seed_started = current, now
            if _stopping.is_set():
                killed = "interrupted"
            elif now - seed_started > seed_limit_s:
                killed = "hang"
            elif now > deadline:
                killed = "timeout"
            if killed:
                process.kill()
                process.wait()
                break
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    lines = out_path.read_text().splitlines()
    module = f"tests.sim.{'run' if kind == 'sim' else 'compaction'}"
    if killed == "hang":
        return _SimulatorRun("caught", seed, f"seed {seed} hangs: still running after {seed_limit_s:.0f} s",
                             f"python -m {module} --seed {seed}")
    if killed:
        return _SimulatorRun("timeout", seed, f"{killed} at seed {seed} of {seeds}")
    for index, line in enumerate(lines):
        if line.startswith("CAUGHT "):
            _, caught_seed, detail = line.split(" ", 2)
            replay = lines[index + 1].removeprefix("REPLAY ") if index + 1 < len(lines) else ""
            return _SimulatorRun("caught", int(caught_seed), detail, replay)
    if lines and lines[-1] == "OK":
        return _SimulatorRun("ok")
    errors = [line for line in err_path.read_text().splitlines() if line.strip()]
    return _SimulatorRun("error", seed, "worker failed: " + (errors[-1][:300] if errors else f"exit {process.returncode}"))


def run_mutant(mutant: Mutant | None, sim_seeds: int, compaction_seeds: int, *,
               seed_limit_s: float = SEED_LIMIT_S, timeout_s: float = TIMEOUT_S,
               simulators: tuple[str, ...] | None = None) -> Outcome:
    """Run the simulators against a mutated scratch copy (``None``: the unmutated tree)."""
    started = time.monotonic()
    seeds = {"sim": sim_seeds, "compaction": compaction_seeds}
    with tempfile.TemporaryDirectory(prefix="metakv-mutant-") as scratch:
        root = Path(scratch)
        copy_tree(root)
        if mutant is not None:
            apply_mutant(root, mutant)
        for kind in simulators or simulators_for(mutant):
            if seeds[kind] <= 0:
                continue
            run = _simulate(root, kind, seeds[kind], seed_limit_s, started + timeout_s)
            if run.status != "ok":
                by = kind if run.status == "caught" else ""
                return Outcome(mutant, run.status, by, run.seed, run.detail, run.replay, time.monotonic() - started)
    return Outcome(mutant, "survived", "", -1, "", "", time.monotonic() - started)


def run_mutants(mutants: list[Mutant], sim_seeds: int, compaction_seeds: int, jobs: int, *,
                seed_limit_s: float = SEED_LIMIT_S, timeout_s: float = TIMEOUT_S,
                report: bool = True) -> tuple[list[Outcome], list[Outcome]]:
    """The unmutated tree on every simulator (the baseline), then every mutant, ``jobs`` at
    a time; returns (baseline outcomes, mutant outcomes in catalogue order)."""
    order = {mutant.name: index for index, mutant in enumerate(mutants)}
    limits = {"seed_limit_s": seed_limit_s, "timeout_s": timeout_s}
    outcomes: list[Outcome] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        try:
            baseline = list(pool.map(lambda kind: run_mutant(None, sim_seeds, compaction_seeds,
                                                             simulators=(kind,), **limits), ("sim", "compaction")))
            if any(outcome.verdict != "survived" for outcome in baseline):
                return baseline, []
            futures = [pool.submit(run_mutant, mutant, sim_seeds, compaction_seeds, **limits) for mutant in mutants]
            for future in concurrent.futures.as_completed(futures):
                outcome = future.result()
                outcomes.append(outcome)
                if report:
                    print(_line(outcome), flush=True)
        except BaseException:  # Ctrl-C: kill the running simulators before the pool waits for them
            _stopping.set()
            raise
    outcomes.sort(key=lambda outcome: order[outcome.mutant.name])  # type: ignore[union-attr]
    return baseline, outcomes


# ---------------------------------------------------------------------- reporting


def replay_command(outcome: Outcome) -> str:
    assert outcome.mutant is not None
    return f"python -m tests.mutants.run --replay {outcome.mutant.name} --command {shlex.quote(outcome.replay)}"


def _line(outcome: Outcome) -> str:
    assert outcome.mutant is not None
    where = f"{outcome.by} seed {outcome.seed}" if outcome.caught else ""
    text = f"{outcome.verdict.upper():9} {outcome.mutant.name:40} {where:22} {outcome.seconds:6.1f} s  {outcome.detail}"
    if outcome.caught:
        text += f"\n          replay: {replay_command(outcome)}"
    return text


def _table(outcomes: list[Outcome]) -> str:
    rows = ["| mutant | verdict | caught by | seed | seconds | failure (invariant) |", "|---|---|---|---|---|---|"]
    for outcome in outcomes:
        assert outcome.mutant is not None
        seed = str(outcome.seed) if outcome.caught else ""
        detail = outcome.detail.replace("|", "\\|")
        rows.append(f"| {outcome.mutant.name} | {outcome.verdict} | {outcome.by} | {seed} | "
                    f"{outcome.seconds:.1f} | {detail} |")
    return "\n".join(rows)


def replay(name: str, command: str) -> int:
    """Run ``command`` (a simulator replay) inside a scratch copy carrying mutant ``name``."""
    mutant = {m.name: m for m in MUTANTS}[name]
    words = shlex.split(command)
    if words and words[0] in ("python", "python3"):
        words[0] = sys.executable
    with tempfile.TemporaryDirectory(prefix="metakv-mutant-") as scratch:
        root = Path(scratch)
        copy_tree(root)
        apply_mutant(root, mutant)
        print(f"# {name} applied to {root}: {mutant.rule}", flush=True)
        env = dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
        return subprocess.run(words, cwd=root, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutants.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="only these mutants (default: the whole catalogue)")
    parser.add_argument("--quick", action="store_true", help="only the subset make test runs")
    parser.add_argument("--sim-seeds", type=int, default=SIM_SEEDS, help="raft simulator seeds at most")
    parser.add_argument("--compaction-seeds", type=int, default=COMPACTION_SEEDS,
                        help="compaction simulator seeds at most")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutants run in parallel")
    parser.add_argument("--seed-limit-s", type=float, default=SEED_LIMIT_S, help="a seed running longer hangs")
    parser.add_argument("--timeout-s", type=float, default=TIMEOUT_S, help="time for one mutant")
    parser.add_argument("--list", action="store_true", help="print the catalogue and exit")
    parser.add_argument("--replay", metavar="NAME", help="run --command on a copy carrying mutant NAME")
    parser.add_argument("--command", help="with --replay: the simulator command to run")
    args = parser.parse_args(argv)
    by_name = {mutant.name: mutant for mutant in MUTANTS}
    if args.list:
        for mutant in MUTANTS:
            print(f"{mutant.name:40} {mutant.path:30} {mutant.rule}")
        return 0
    if args.replay is not None:
        if args.replay not in by_name or not args.command:
            parser.error("--replay needs a catalogued mutant name and --command")
        return replay(args.replay, args.command)
    unknown = [name for name in args.names if name not in by_name]
    if unknown:
        parser.error(f"unknown mutant(s): {', '.join(unknown)}")
    chosen = [by_name[name] for name in args.names] or [m for m in MUTANTS if not args.quick or m.name in QUICK]
    started = time.monotonic()
    print(f"{len(chosen)} mutants, at most {args.sim_seeds} sim and {args.compaction_seeds} compaction seeds "
          f"each, {args.jobs} at a time", flush=True)
    baseline, outcomes = run_mutants(chosen, args.sim_seeds, args.compaction_seeds, args.jobs,
                                     seed_limit_s=args.seed_limit_s, timeout_s=args.timeout_s)
    broken = [outcome for outcome in baseline if outcome.verdict != "survived"]
    if broken:
        for outcome in broken:
            print(f"the unmutated tree fails: {outcome.detail} (replay: {outcome.replay})")
        return 2
    print("unmutated tree: " + ", ".join(f"{kind} {o.seconds:.1f} s" for kind, o in zip(("sim", "compaction"), baseline, strict=True)))
    print(_table(outcomes))
    not_caught = [outcome for outcome in outcomes if not outcome.caught]
    print(f"{len(outcomes) - len(not_caught)}/{len(outcomes)} mutants caught in {time.monotonic() - started:.0f} s "
          f"({args.sim_seeds} sim seeds, {args.compaction_seeds} compaction seeds at most each)")
    for verdict in ("survived", "timeout", "error"):
        names = [o.mutant.name for o in not_caught if o.verdict == verdict]  # type: ignore[union-attr]
        if names:
            print(f"{verdict}: {', '.join(names)}")
    return 1 if not_caught else 0


if __name__ == "__main__":
    sys.exit(main())
