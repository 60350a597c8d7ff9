"""The benchmarks as a user runs them: ``python -m maskconv_kernels.bench``, its folders, its renderer."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from maskconv_kernels.bench import __main__ as cli
from maskconv_kernels.bench import decode, machine

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"
INTERNAL = ("issue", "seed", "acceptance", "the bar")


def test_help_lists_the_modes_and_a_measured_estimate():
    proc = subprocess.run([sys.executable, "-m", "maskconv_kernels.bench", "--help"], capture_output=True, text=True,
                          timeout=120, check=True)
    for words in ("conv", "sequence", "roofline", "decode", "render", "--preset cpu", "2-core", "--out DIR"):
        assert words in proc.stdout, words
    assert not any(w in proc.stdout.lower() for w in INTERNAL)


@pytest.mark.parametrize("mode", [*cli.MODES, "render"])
def test_every_mode_has_help_in_users_words(mode, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([mode, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "--out" in text and not any(w in text.lower() for w in INTERNAL), text


@pytest.mark.slow  # a whole benchmark run
def test_a_run_writes_a_new_folder_under_the_current_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["--quick", "--shapes", "7x7A_C1-64", "--modes", "fwd", "--dtypes", "float32", "--no-chart"]
    assert cli.main(args) == 0
    (folder,) = tmp_path.glob("maskconv-bench-conv-*")
    assert sorted(p.name for p in folder.iterdir()) == ["conv_cpu.jsonl", "conv_cpu.md"]
    rows = [json.loads(line) for line in (folder / "conv_cpu.jsonl").read_text().splitlines()]
    assert {r["implementation"] for r in rows} >= {"baseline", "xla"}
    for r in rows:
        assert r["command"] == "python -m maskconv_kernels.bench conv " + " ".join(args)  # the mode made explicit
        for key in ("device", "cpu_model", "jax", "jaxlib", "python", "maskconv_kernels", "time_utc", "commit"):
            assert key in r, key
    out = capsys.readouterr().out
    assert "## Summary" in out and not any(w in out.lower() for w in INTERNAL)
    # A second run the same second gets its own folder: nothing is written over.
    assert cli._new_folder("conv") != folder


def test_out_and_name_choose_the_files(tmp_path):
    args = ["conv", "--quick", "--shapes", "7x7A_C1-64", "--modes", "fwd", "--dtypes", "float32", "--no-chart",
            "--out", str(tmp_path / "mine"), "--name", "run1"]
    assert cli.main(args) == 0
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["run1.jsonl", "run1.md"]


@pytest.mark.parametrize("name", ["cpu", "sequence_cpu_jax0.12", "roofline_cpu_jax0.10", "decode_cpu",
                                  "serving_cpu_jax0.10"])
def test_the_committed_results_still_render(name, tmp_path, capsys):
    committed = RESULTS / f"{name}.jsonl"
    before = committed.read_bytes()
    assert cli.main(["render", str(committed), "--out", str(tmp_path), "--no-chart"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("Device:") or printed.startswith("# Generation time")
    written = (tmp_path / f"{name}.md").read_text()
    assert written.splitlines()[0] == printed.splitlines()[0]  # the same run's header
    assert len(written.splitlines()) > 5
    assert committed.read_bytes() == before and not (tmp_path / f"{name}.jsonl").exists()


def test_render_says_what_it_cannot_read(tmp_path, capsys):
    stray = tmp_path / "x.jsonl"
    stray.write_text(json.dumps({"something": 1}) + "\n")
    assert cli.main(["render", str(stray)]) == 1
    assert "rows of no benchmark" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="cannot read"):
        cli.main(["render", str(tmp_path / "missing.jsonl")])


def test_decode_needs_the_examples_and_says_where_it_looked(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match=r"no examples folder was found at .*--examples"):
        decode.load_examples(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="run it from a clone"):
        cli.main(["decode", "--quick", "--examples", str(tmp_path / "nowhere")])
    assert not list(tmp_path.iterdir())  # the run wrote nothing, so it left no folder


def test_the_commit_is_claimed_only_from_a_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv("MASKCONV_COMMIT", raising=False)
    monkeypatch.setattr(machine, "_SOURCE", tmp_path)  # an installed copy: no .git beside the package
    assert machine.commit() is None
    monkeypatch.setenv("MASKCONV_COMMIT", "abc123")
    assert machine.commit() == "abc123"
    assert machine.short_commit(None) == "unknown" and machine.short_commit("0123456789abcdef-dirty") == \
        "0123456789ab-dirty"
