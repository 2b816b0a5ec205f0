"""One simulator over a range of seeds, one seed at a time through its own command line:
``python -m tests.mutants.worker sim|compaction FIRST COUNT``.

tests/mutants/run.py starts this inside a mutated scratch copy. Each seed is announced on
stdout before it runs (so a seed that hangs can be named), and the run ends with one line:
``OK``, or ``CAUGHT <seed> <first line of the failure>`` followed by ``REPLAY <command>``.
A crash (a ``check`` in the core, any exception) counts as caught: the simulator stopped.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import sys
from pathlib import Path

SIMULATORS = {"sim": "tests.sim.run", "compaction": "tests.sim.compaction"}
_REPLAY = re.compile(r"python -m tests\.sim\.[a-z_]+ --seed \d+(?: --voters \d+)?")


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "exit 1 without a message"
    return re.sub(r"^(seed \d+: )\1", r"\1", lines[0].removeprefix("FAIL "))[:400]  # said once is enough


def run_seeds(kind: str, first: int, count: int) -> int:
    module_name = SIMULATORS[kind]
    simulator = importlib.import_module(module_name)
    here = Path.cwd().resolve()
    for module in (simulator, importlib.import_module("raft"), importlib.import_module("storage")):
        if not Path(module.__file__ or "").resolve().is_relative_to(here):  # the scratch copy, never the real tree
            raise SystemExit(f"{module.__name__} imported from {module.__file__}, not from {here}")
    for seed in range(first, first + count):
        print(f"SEED {seed}", flush=True)
        errors = io.StringIO()
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(errors):
                code = simulator.main(["--seed", str(seed), "--seeds", "1"])
        except Exception as exc:  # noqa: BLE001 - any crash stops the simulator: caught
            detail = f"crash: {type(exc).__name__}: {exc}".splitlines()[0][:400]
            print(f"CAUGHT {seed} {detail}")
            print(f"REPLAY python -m {module_name} --seed {seed}", flush=True)
            return 1
        if code:
            text = errors.getvalue()
            replay = _REPLAY.search(text)
            print(f"CAUGHT {seed} {_first_line(text)}")
            print(f"REPLAY {replay.group(0) if replay else f'python -m {module_name} --seed {seed}'}", flush=True)
            return 1
    print("OK", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    kind, first, count = argv if argv is not None else sys.argv[1:]
    return run_seeds(kind, int(first), int(count))


if __name__ == "__main__":
    sys.exit(main())
