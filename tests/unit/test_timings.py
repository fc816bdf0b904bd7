"""Every time the README and the docs state is a measured row of docs/timings.csv, with its
machine and load (tools/timings.py): the table of docs/reference/timings.md and each sentence
that quotes a row are the record's, and no page states a round time of its own. The commands
are not rerun here (their times are minutes; the record says when and where each was taken)."""

import re
from pathlib import Path

import pytest

from tools import timings

ROOT = Path(__file__).resolve().parents[2]
# A time a sentence states by itself: "about a minute", "under a minute", "~2 min", "in 20 s",
# "30 minutes", "1 to 1.5 minutes".
ROUND_TIME = re.compile(
    r"\b(?:about|under|around|roughly|nearly|within|in)\s+(?:a|an|one|\d[\d,.]*(?:-\d[\d,.]*)?)\s*"
    r"(?:minutes?|min|hours?|seconds?|s)\b"
    r"|~\s*\d[\d,.]*\s*(?:minutes?|min|hours?|seconds?|s)\b"
    r"|\b\d[\d,.]*(?:\s*(?:-|to)\s*\d[\d,.]*)?\s*(?:minutes?|min|hours?)\b",
    re.I,
)
# Benchmark results, printed with their commands and CSV files.
OWN_MEASUREMENTS = {"docs/benchmarks.md"}
# Times that are not a command's duration: settings, budgets, a prediction, the record of how
# the shipped demo models were made. (page, the words) -> what it is.
NOT_DURATIONS = {
    ("docs/bad_inputs.md", "10 minutes"): "--dist-timeout's default",
    ("docs/index.md", "in 480 s"): "gpu_check.sh's budget on one GPU",
    ("docs/guides/evaluation.md", "44 minutes"): "how models/demo-base was pretrained (its own record)",
    ("docs/guides/evaluation.md", "within 13 minutes"): "the research runs that made the demo, as recorded",
    ("docs/guides/real-model.md", "about 8 minutes"): "the planner's prediction, printed by the command beside it",
}


def pages() -> list[Path]:
    return [p for p in timings.QUOTING if str(p.relative_to(ROOT)) not in OWN_MEASUREMENTS]


def test_the_table_is_the_record():
    page = timings.PAGE.read_text()
    block = page.split(timings.BEGIN + "\n", 1)[1].split("\n" + timings.END, 1)[0]
    assert block == timings.table(timings.read()), "run: python -m tools.timings --write"


def test_every_quoted_time_is_its_rows():
    rows = timings.read()
    quoted = {}
    for path in timings.QUOTING:
        for name, text in timings.quotes_in(path.read_text()):
            assert name in rows, f"{path.relative_to(ROOT)} quotes the timing {name!r}, which docs/timings.csv lacks"
            assert text == timings.quote(rows[name]), f"{path.relative_to(ROOT)}: run python -m tools.timings --write"
            quoted[name] = path
    assert {"default-job", "fast-tier", "ci"} <= set(quoted)  # the README's and getting started's times


def test_each_row_is_its_commands_with_the_machine_it_ran_on():
    rows = timings.read()
    assert rows
    for name, row in rows.items():
        assert row.command == timings.COMMANDS[name][0], f"{name}: the record's command is not the tool's"
        assert row.seconds > 0 and row.cores > 0 and row.source
        if row.source.startswith("measured here"):  # a run of tools/timings.py records all of it
            assert row.cpu and row.load_before and row.load_after and row.date


def test_no_page_states_a_round_time_of_its_own():
    found = []
    for path in pages():
        text = timings.QUOTE.sub("", path.read_text())
        if timings.BEGIN in text:  # the table of the record: every row measured
            head, rest = text.split(timings.BEGIN, 1)
            text = head + "\n" * rest.split(timings.END, 1)[0].count("\n") + rest.split(timings.END, 1)[1]
        for number, line in enumerate(text.splitlines(), 1):
            page = str(path.relative_to(ROOT))
            found += [
                f"{page}:{number}: {m.group(0)!r}"
                for m in ROUND_TIME.finditer(line)
                if (page, m.group(0)) not in NOT_DURATIONS
            ]
    assert not found, (
        "times stated without a measurement (quote a row of docs/timings.csv: python -m tools.timings): "
        + "; ".join(found)
    )


@pytest.mark.parametrize(
    "sentence, stated",
    [
        ("the default job runs in about a minute", True),
        ('`-m "not slow"`: the one-process tier, under a minute', True),
        ("a 10-task suite (~2 min)", True),
        ("about 50 minutes on 2 cores", True),
        ("in 1-1.5 minutes on 2 cores", True),
        ("(300 steps, 1 to 1.5 minutes on 2 cores)", True),
        ("30 minutes for four models", True),
        ("--dist-timeout SECONDS (default 600 s)", False),
        ("each rank waits up to 5 s", False),
        ("<!-- timing:default-job -->1 min 38 s on 2 cores<!-- /timing -->", False),
    ],
)
def test_a_round_time_is_found_and_a_setting_or_quote_is_not(sentence, stated):
    assert bool(ROUND_TIME.search(timings.QUOTE.sub("", sentence))) == stated


def test_a_quote_is_rewritten_from_its_row_and_an_unknown_row_refused():
    row = timings.Timing("default-job", "c", 98.4, 2, "CPU", "2.5", "3.1", "2026-12-07", "measured here")
    text = "takes <!-- timing:default-job -->about a minute<!-- /timing --> here"
    assert timings.with_quotes(text, {"default-job": row}) == (
        "takes <!-- timing:default-job -->1 min 38 s on 2 cores, load 2.5 before it started<!-- /timing --> here"
    )
    with pytest.raises(SystemExit, match="'fast-tier', which docs/timings.csv does not have"):
        timings.with_quotes("<!-- timing:fast-tier -->x<!-- /timing -->", {"default-job": row})
    assert [timings.duration(s) for s in (13.2, 59.6, 98.4, 3312)] == ["13 s", "1 min 0 s", "1 min 38 s", "55 min 12 s"]
