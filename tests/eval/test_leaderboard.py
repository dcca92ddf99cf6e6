"""``kvcompress leaderboard`` end to end on a tiny model and a 2-sample grid: every cell in the page, resumable."""

import re

from kvcompress.cli import main as cli_main
from kvcompress.eval.leaderboard import PROTOCOLS, table

METHODS = ["snapkv", "streamingllm", "kivi"]
RATIOS = [0.1, 0.5]


def _table_rows(page: str, heading: str) -> list[list[str]]:
    section = page.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| size")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_leaderboard_runs_every_cell_and_lists_it(tiny_checkpoint, tmp_path, capsys):
    model = str(tiny_checkpoint("llama"))
    argv = ["leaderboard", "--models", model, "--methods", ",".join(METHODS), "--ratios", ",".join(map(str, RATIOS)),
            "--samples", "1", "--context-tokens", "160", "--out", str(tmp_path / "lb"), "--quiet"]
    assert cli_main(argv) == 0
    page = (tmp_path / "lb" / "leaderboard.md").read_text()
    assert (tmp_path / "lb" / "leaderboard.png").stat().st_size > 10_000
    for protocol in PROTOCOLS:
        heading = next(h for h in re.findall(r"^## .*$", page, flags=re.M) if protocol.split("-")[1] in h)
        rows = _table_rows(page, heading)
        cells = {(r[0], r[1]) for r in rows}
        expected = {("—", "full")} | {(f"{ratio:g}", m) for ratio in RATIOS for m in METHODS if m != "kivi"} | {("own", "kivi")}
        assert cells == expected, (protocol, cells)
        for row in rows:
            assert re.fullmatch(r"\**\d+\.\d\**( †)?", row[2]) and float(row[3]) > 0 and int(row[7]) == 5  # 5 tasks × 1 sample
        for ratio in RATIOS:  # one best per size, in bold
            assert sum(r[2].startswith("**") for r in rows if r[0] == f"{ratio:g}") >= 1
    # a second run finds every cell finished and only rewrites the page
    (tmp_path / "lb" / "leaderboard.md").unlink()
    capsys.readouterr()
    assert cli_main(argv) == 0
    assert "leaderboard:" not in capsys.readouterr().err
    assert (tmp_path / "lb" / "leaderboard.md").read_text() == page


def test_unknown_protocol_is_refused(tmp_path, capsys):
    assert cli_main(["leaderboard", "--protocols", "question-before", "--out", str(tmp_path)]) == 2
    assert "question-after" in capsys.readouterr().err


def test_a_method_that_keeps_every_entry_is_listed_but_not_ranked():
    """Quest and OmniKV read a size's share but hold the whole cache (kr ≥ 1): the best of a size is the best method
    that frees memory."""
    def row(method, score, kr, ratio=0.1):
        return {"task": "all", "method": method, "ratio": ratio, "budget": None, "score": score, "kr": kr, "cr": 0.2, "n": 20,
                "compress_s": 0.0, "prefill_s": 1.0, "decode_ms_per_token": 10.0}
    lines = table([row("full", 60.0, 1.0, None), row("omnikv", 67.0, 1.016), row("kvzip", 47.0, 0.101), row("snapkv", 1.0, 0.101)])
    cells = {line.split("|")[2].strip(): line.split("|")[3].strip() for line in lines[2:]}
    assert cells == {"full": "60.0", "omnikv": "67.0 †", "kvzip": "**47.0**", "snapkv": "1.0"}
