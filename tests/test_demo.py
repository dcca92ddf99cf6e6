"""``kvcompress demo`` on a tiny checkpoint: its table, and what Ctrl-C keeps."""

import kvcompress.cli as cli


def test_ctrl_c_prints_the_runs_that_finished_and_exits_130(tiny_checkpoint, monkeypatch, capsys):
    real, calls = cli.generate, []

    def generate_then_interrupt(*args, **kwargs):
        calls.append(args[4].name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(cli, "generate", generate_then_interrupt)
    argv = ["demo", "--model", str(tiny_checkpoint()), "--methods", "snapkv,h2o", "--context-tokens", "30", "--quiet"]
    capsys.readouterr()  # saving the checkpoint reports progress
    assert cli.main(argv) == 130
    out, err = capsys.readouterr()
    table = [line for line in out.splitlines() if line.startswith("| ") and "protocol" not in line]
    assert [line.split("|")[1].strip() for line in table] == ["full", "snapkv"]  # the two runs that finished
    assert "query-agnostic" in table[0] and "Built-in prompt" in out
    assert err.strip() == "kvcompress: interrupted after 2 of 6 runs; the table above holds them"


def test_demo_prints_every_run(tiny_checkpoint, capsys):
    argv = ["demo", "--model", str(tiny_checkpoint()), "--methods", "snapkv", "--context-tokens", "30", "--quiet"]
    assert cli.main(argv) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "protocol" not in line]
    assert [(line.split("|")[1].strip(), line.split("|")[2].strip()) for line in table] == [
        ("full", "query-agnostic"), ("snapkv", "query-agnostic"), ("full", "query-aware"), ("snapkv", "query-aware")]
