"""The times the README and the docs state, each measured by a command that prints it.

    python -m tools.timings run NAME        run NAME's command here, print its wall time, the
                                            machine and its load, and record the row
    python -m tools.timings record NAME --seconds S --cores N --source WHERE
                                            record a time measured elsewhere (CI's log), saying where
    python -m tools.timings --write         the table of docs/reference/timings.md and every sentence
                                            that quotes a row, from the record

The record is docs/timings.csv, one row per command. A row measured here carries the CPU, the
cores and the load average (1 minute) before and after the run: on a shared 2-core machine a
command takes several times what it takes alone, so the load is part of the number. A sentence
quotes a row between `<!-- timing:NAME -->` and `<!-- /timing -->`; tests/unit/test_timings.py
keeps the table and those quotes equal to the record (it never runs the commands).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "timings.csv"
PAGE = ROOT / "docs" / "reference" / "timings.md"
QUOTING = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TORCHRUN_2 = "torchrun --standalone --nproc_per_node 2"
# NAME -> (the command as a user types it, from the repository root; what it is)
COMMANDS = {
    "default-job": (f"{TORCHRUN_2} train.py", "the default job: the demo base extended to 2,048 tokens, 300 steps"),
    "fast-tier": ('python -m pytest -m "not slow" -q -p no:cacheprovider', "the fast tier: every one-process test"),
    "fast-tier-floors": (
        'python -m pytest -m "not slow"',
        "the fast tier on the floor versions (.ci/run stage 2: torch 2.11, transformers 5.9)",
    ),
    "ci": ("bash .ci/run", "CI from a fresh clone: installs, the whole suite, the fast tier on the floors, GPU stack"),
    "eval-needle": (f"{TORCHRUN_2} eval_needle.py --generate", "needles, 8 lengths x 5 depths x 2 samples"),
    "eval-ppl": (f"{TORCHRUN_2} eval_ppl.py", "perplexity, 256 to 4K tokens, 4 held-out samples"),
    "eval-ruler": (f"{TORCHRUN_2} eval_ruler.py --samples 10", "the RULER-style suite: 11 tasks x 3 lengths"),
    "real-model-ppl": (
        f"{TORCHRUN_2} eval_ppl.py -m smollm2-135m-instruct -m models/smollm2-135m-instruct-linear4"
        " -m models/smollm2-135m-instruct-dynamic4 -m models/smollm2-135m-instruct-yarn4"
        " -d outputs/real/held_out_docs.jsonl -f text --samples 1 --min-tokens 1024 --max-tokens 32768 --truncate"
        " --output-file outputs/real/ppl.csv",
        "SmolLM2-135M-Instruct and 3 scalings, perplexity 1K-32K (docs/guides/real-model.md)",
    ),
    "real-model-needle": (
        f"{TORCHRUN_2} eval_needle.py --model smollm2-135m-instruct --chat-template --generate --max-new-tokens 32"
        " --min-context-length 4096 --max-context-length 16384 --context-interval 4096 --depth-interval 0.25"
        " --num-samples 1 --output-dir outputs/real/needle",
        "SmolLM2-135M-Instruct, 20 needles 4K-16K through the chat template (docs/guides/real-model.md)",
    ),
    "real-model-ruler": (
        f"{TORCHRUN_2} eval_ruler.py --model smollm2-135m-instruct --lengths 4096,12288 --samples 1"
        " --output-dir outputs/real/ruler --hide-progress",
        "SmolLM2-135M-Instruct, the 11 RULER-style tasks at 4K and 12K, one prompt each (docs/guides/real-model.md)",
    ),
    "real-model-ruler-yarn": (
        f"{TORCHRUN_2} eval_ruler.py --model models/smollm2-135m-instruct-yarn4 --lengths 4096,12288 --samples 1"
        " --output-dir outputs/real/ruler --hide-progress",
        "the same tasks on the YaRN x4 folder (docs/guides/real-model.md)",
    ),
}
BEGIN, END = "<!-- timings:begin -->", "<!-- timings:end -->"
QUOTE = re.compile(r"<!-- timing:([\w-]+) -->(.*?)<!-- /timing -->")


@dataclass
class Timing:
    name: str
    command: str
    seconds: float
    cores: int
    cpu: str  # "" where the source does not say
    load_before: str  # the 1-minute load average, "" where not recorded
    load_after: str
    date: str
    source: str  # "measured here by tools/timings.py", or where a time measured elsewhere was read


def read() -> dict[str, Timing]:
    if not RECORD.exists():
        return {}
    with RECORD.open() as f:
        return {
            row["name"]: Timing(**{**row, "seconds": float(row["seconds"]), "cores": int(row["cores"])})
            for row in csv.DictReader(f)
        }


def write_record(rows: dict[str, Timing]) -> None:
    with RECORD.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[field.name for field in fields(Timing)], lineterminator="\n")
        writer.writeheader()
        for name in sorted(rows, key=list(COMMANDS).index):
            writer.writerow(asdict(rows[name]))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def duration(seconds: float) -> str:
    """98.4 -> '1 min 38 s'; 13.2 -> '13 s'."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{hours} h " if hours else "") + f"{minutes} min {secs} s"


def quote(row: Timing) -> str:
    """What a sentence quotes of a row: the time, the machine, the load."""
    load = f", load {row.load_before} before it started" if row.load_before else ", load not recorded"
    return f"{duration(row.seconds)} on {row.cores} cores{load}"


def table(rows: dict[str, Timing]) -> str:
    lines = [
        "| what | command | wall time | machine | load (1 min) before / after | measured | source |",
        "|---|---|---:|---|---|---|---|",
    ]
    for name in sorted(rows, key=list(COMMANDS).index):
        row = rows[name]
        machine = f"{row.cores} cores" + (f", {row.cpu}" if row.cpu else "")
        load = f"{row.load_before} / {row.load_after}" if row.load_before else "not recorded"
        what = COMMANDS[name][1]
        lines.append(
            f"| `{name}`: {what} | `{row.command}` | {duration(row.seconds)} ({row.seconds:.0f} s) | {machine} "
            f"| {load} | {row.date} | {row.source} |"
        )
    return "\n".join(lines)


def quotes_in(text: str) -> list[tuple[str, str]]:
    """(row name, quoted text) of every timing quote in a page."""
    return QUOTE.findall(text)


def with_quotes(text: str, rows: dict[str, Timing]) -> str:
    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name not in rows:
            raise SystemExit(f"a page quotes the timing {name!r}, which docs/timings.csv does not have: {list(rows)}")
        return f"<!-- timing:{name} -->{quote(rows[name])}<!-- /timing -->"

    return QUOTE.sub(replace, text)


def with_table(page: str, rows: dict[str, Timing]) -> str:
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table(rows)}\n{END}{tail}"


def write_pages(rows: dict[str, Timing]) -> None:
    PAGE.write_text(with_table(PAGE.read_text(), rows))
    for path in QUOTING:
        text = path.read_text()
        new = with_quotes(text, rows)
        if new != text:
            path.write_text(new)


def load_average() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def run(name: str) -> Timing:
    """Run NAME's command from the repository root (this interpreter's bin first on PATH, so
    `python` and `torchrun` are its own) and time it; raises if the command fails."""
    command = COMMANDS[name][0]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    before = load_average()
    start = time.monotonic()
    result = subprocess.run(command, shell=True, cwd=ROOT, env=env)
    seconds = time.monotonic() - start
    if result.returncode != 0:
        raise SystemExit(f"{command!r} exited with {result.returncode} after {seconds:.0f} s: not recorded")
    return Timing(
        name=name,
        command=command,
        seconds=round(seconds, 1),
        cores=os.cpu_count() or 1,
        cpu=cpu_model(),
        load_before=before,
        load_after=load_average(),
        date=datetime.date.today().isoformat(),
        source="measured here by `python -m tools.timings run " + name + "`",
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.timings", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="the table and the quotes from docs/timings.csv")
    sub = parser.add_subparsers(dest="action")
    run_parser = sub.add_parser("run", help="run a command, time it, record it")
    run_parser.add_argument("name", choices=list(COMMANDS))
    record_parser = sub.add_parser("record", help="record a time measured elsewhere")
    record_parser.add_argument("name", choices=list(COMMANDS))
    record_parser.add_argument("--seconds", type=float, required=True)
    record_parser.add_argument("--cores", type=int, required=True)
    record_parser.add_argument("--cpu", default="")
    record_parser.add_argument("--date", default="", help="when it ran, where the source says")
    record_parser.add_argument("--source", required=True, help="where the time was read (a log, a run's report)")
    args = parser.parse_args(argv)
    if args.action == "run":
        row = run(args.name)
    rows = read()  # after the run: a row recorded meanwhile stays
    if args.action == "record":
        command = COMMANDS[args.name][0]
        row = Timing(args.name, command, args.seconds, args.cores, args.cpu, "", "", args.date, args.source)
    if args.action:
        rows[args.name] = row
        write_record(rows)
        cpu = row.cpu or "CPU not recorded"
        print(f"{args.name}: {row.command}: {quote(row)} ({cpu}; load after {row.load_after or 'not recorded'})")
    if args.write or args.action:
        write_pages(rows)
    if not (args.write or args.action):
        print(table(rows))


if __name__ == "__main__":
    main()
