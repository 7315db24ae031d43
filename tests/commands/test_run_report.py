"""``run report``: one self-contained HTML page of a run. Of a real (in-process) run's data dirs it draws
the training curves, the step diagnostics and the throughput from the trainer's metrics; of data dirs
that hold more (other diagnostics, held-out results, rejected work, audits) it shows those too; it loads
nothing from outside; operator mistakes name the flag. Where headless Chromium is installed, the page is
rendered and a screenshot kept."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from intellect_node.cli import app
from intellect_node.commands.report import collect, diagnostics, node_dirs
from intellect_node.config.ledger import Ledger
from intellect_node.errors import ConfigError
from intellect_node.fsutil import read_jsonl
from tests.support.trained_run import trained_run

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of a real run's data dirs (``trainer``, ``validator``, ``w``)."""
    return trained_run(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def report(run: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Path]:
    """``run report`` of :func:`run`'s data dirs with its PNGs kept: the result, the page, the PNG dir
    (the page is kept with pytest's last runs)."""
    d = tmp_path_factory.mktemp("report")
    out, pngs = d / "report.html", d / "png"
    r = invoke("run", "report", "--data-dir", str(run), "--out", str(out), "--png-dir", str(pngs),
               "--title", "Addition run")
    return r, out, pngs


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def _images(page: str) -> dict[str, bytes]:
    """The page's inlined images by their section's id."""
    found = re.findall(r"<h2 id='(\w+)'>[^<]*</h2><img alt='[^']*' src='data:image/png;base64,([^']+)'>",
                       page)
    return {name: base64.b64decode(data) for name, data in found}


def test_a_real_runs_report_draws_its_curves_in_one_page(run: Path, report: tuple[Any, Path, Path]) -> None:
    r, out, pngs = report
    assert r.exit_code == 0, r.output
    page = out.read_text()
    lines = read_jsonl(run / "trainer" / "trainer" / "metrics.jsonl")
    trained = [m for m in lines if m.get("trained")]
    assert f"{len(trained)} trained of {len(lines)} attempted" in page
    assert "<title>Addition run</title>" in page
    images = _images(page)
    assert set(images) == {"training", "diagnostics", "timings", "throughput"}
    for name, data in images.items():
        assert data.startswith(PNG) and (pngs / f"{name}.png").read_bytes() == data, name
    assert not re.search(r"(src|href)=['\"]?(https?:|//)", page)  # nothing loaded from elsewhere
    assert "<script" not in page
    # the trainer's data dir alone gives the same curves; a worker's alone says where they are
    assert node_dirs([run]) == [run / "trainer", run / "validator", run / "w"]
    assert len(collect([run / "trainer"]).steps) == len(lines)
    assert "give the trainer's data dir" in collect([run / "w"]).notes[0]


def _synthetic(root: Path) -> Path:
    """A trainer's data dir with diagnostics of another loss (kl, lr, entropy), a held-out file, a worker's
    ledger with rejected work, an auditor's verdicts with a failure and its evidence; a torn last line."""
    d = root / "node"
    (d / "trainer").mkdir(parents=True)
    lines = [{"step": i, "version": i, "trained": True, "time": 1000.0 + 5 * i, "samples": 16,
              "reward_mean": 0.1 * i, "pass_rate": 0.05 * i, "kl": 0.01 * i, "lr": 1e-6,
              "entropy": 2.0 - 0.1 * i, "loss": 0.5, "batch_ages": [0, 1], "accepted": 16 * i,
              "rejected": 4, "stale": 0, "train_s": 0.2}
             for i in range(1, 6)]
    text = "".join(json.dumps(m) + "\n" for m in lines) + '{"step": 6, "vers'
    (d / "trainer" / "metrics.jsonl").write_text(text)
    (d / "evaluator").mkdir()
    (d / "evaluator" / "held_out.jsonl").write_text("".join(
        json.dumps({"version": v, "pass_rate": 0.1 * v, "mean_reward": 0.1 * v, "n": 256,
                    "evaluator": "12D3KooWx"}) + "\n" for v in (4, 0, 2)))
    with Ledger(d / "ledger.sqlite") as ledger:
        ledger.record_submission("b1", run_id="r", policy_version=1, n_rollouts=8, n_tokens=80)
        ledger.record_verdict("b1", validator="v", run_id="r", n_accepted=0, n_rejected=8, reason="toploc")
        ledger.record_submission("b2", run_id="r", policy_version=1, n_rollouts=8, n_tokens=80)
        ledger.record_verdict("b2", validator="v", run_id="r", n_accepted=0, n_rejected=8, reason="stale")
        ledger.record_submission("b3", run_id="r", policy_version=1, n_rollouts=8, n_tokens=80)
        ledger.record_verdict("b3", validator="v", run_id="r", n_accepted=0, n_rejected=8, reason="toploc")
    (d / "auditor").mkdir()
    (d / "auditor" / "verdicts.jsonl").write_text(
        json.dumps({"seq": 1, "outcome": "pass"}) + "\n" + json.dumps({"seq": 2, "outcome": "fail"}) + "\n")
    ev = d / "audits" / "r" / "evidence"
    ev.mkdir(parents=True)
    (ev / "2.json").write_text(json.dumps({"seq": 2, "version": 2, "auditor": "12D3KooWa",
                                           "reason": "weights differ from the replay"}))
    return d


def test_what_the_data_dirs_hold_is_shown(tmp_path: Path) -> None:
    d = _synthetic(tmp_path)
    data = collect(node_dirs([d]))
    assert len(data.steps) == 5  # the torn line is left out
    assert [m["version"] for m in data.held_out] == [0, 2, 4]
    assert data.rejections == {"toploc": 16, "stale": 8}
    assert data.audits == {"pass": 1, "fail": 1}
    keys = list(diagnostics(data.steps))
    assert keys[:5] == ["loss", "kl", "lr", "entropy", "batch_age_mean"]  # the preferred ones first
    assert "train_s" in keys and "reward_mean" not in keys and "accepted" not in keys
    out = tmp_path / "r.html"
    r = invoke("run", "report", "--data-dir", str(d), "--out", str(out))
    assert r.exit_code == 0, r.output
    page = out.read_text()
    assert set(_images(page)) == {"training", "held_out", "diagnostics", "timings", "throughput"}
    assert "<td>toploc</td><td>16</td>" in page and "<td>stale</td><td>8</td>" in page
    assert "State: <b>failed</b>" in page and "weights differ from the replay" in page
    assert "v4: pass rate 0.4" in page


def test_operator_mistakes_name_the_flag(tmp_path: Path, run: Path) -> None:
    def error(*args: str) -> str:
        r = invoke("run", "report", *args)
        assert isinstance(r.exception, ConfigError), r.output
        return str(r.exception)

    assert "--data-dir" in error("--data-dir", str(tmp_path / "missing"), "--out", str(tmp_path / "r.html"))
    (tmp_path / "empty").mkdir()
    assert "--data-dir" in error("--data-dir", str(tmp_path / "empty"), "--out", str(tmp_path / "r.html"))
    assert "--out" in error("--data-dir", str(run), "--out", str(tmp_path))
    assert not (tmp_path / "r.html").exists()
    nothing = error("--out", str(tmp_path / "r.html"))
    assert "--data-dir" in nothing and "--run CID" in nothing
    assert "--run 'not-a-cid' is not a CID" in error("--run", "not-a-cid", "--out", str(tmp_path / "r.html"))


CHROMIUM = next((b for b in ("chromium", "chromium-browser", "google-chrome", "chrome") if shutil.which(b)),
                None)


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed")
def test_headless_chromium_renders_the_page_with_its_plots(report: tuple[Any, Path, Path],
                                                           tmp_path: Path) -> None:
    r, out, _ = report
    shot = tmp_path / "run-report.png"  # kept with pytest's last runs
    assert r.exit_code == 0, r.output
    assert CHROMIUM is not None
    r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--screenshot={shot.absolute()}", "--window-size=1200,3000", out.as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert shot.read_bytes().startswith(PNG) and shot.stat().st_size > 50_000  # plots drawn, not a blank page
