"""A run found and joined by its CID, with real processes on 127.0.0.1.

An organiser makes a run with ``intellect-node run init`` on a tiny random Qwen3 (keys, fitted settings,
preflight, thresholds calibrated on the run's prompts, the signed manifest as a blob) and its trainer
serves it with ``join --run CID``. A validator joins by CID; ``runs`` on a fresh node that knows only the
trainer's address lists the run; a fresh worker with nothing but a key and that address joins by the
run's ID (pinned to the organiser) and gets a batch accepted, its model folder fetched by hash
byte-identical to the organiser's. The run has the real-family runs' settings
(``tests.support.real_swarm.RL``, ``tests/system/test_real_model_swarm.py`` says why), given with
``--config`` but for the reward format and prompt ``run init`` chooses, and is checked as those runs are
(``tests.support.real_swarm.check_run``): the trainer takes two GRPO steps on
``reasoning_gym:basic_arithmetic`` with no honest rollout rejected, and the worker follows its policy.

Meanwhile, what a participant must refuse, each with a clear reason and exit 1: a manifest whose field
was changed under the organiser's signature, one signed by another key in the organiser's name, the
genuine run under another ``--organiser``, and a correctly signed manifest whose model file no node holds
(that one by the console script, a process's exit code). Operator mistakes exit 2 naming the flag.
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest

from intellect_node.node.processes import write_config
from intellect_node.p2p.identity import init_key, load_key
from intellect_node.p2p.peerbook import PeerBook
from intellect_node.protocol import codec
from intellect_node.protocol.ids import cid_of
from intellect_node.protocol.run_manifest import (
    RUN_DOMAIN,
    open_run_manifest,
    seal_run_manifest,
)
from intellect_node.protocol.signing import Envelope, SigningKey
from tests.support.cli import invoke_cli
from tests.support.common import CLI, run_cli
from tests.support.families import build_family_model
from tests.support.ports import free_port
from tests.support.real_swarm import RL, SHAPE, STEPS, check_run, drawn_for_a_new_version, trained
from tests.support.roles import ENV
from tests.support.swarm import NodeProcess
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

GIVEN_RL = {k: v for k, v in RL.items() if k not in ("env", "env_args", "answer_format", "system_prompt")}
"""The real-family runs' settings (``tests.support.real_swarm.RL``) but those ``run init`` chooses for a
small model with a chat template (the reward format and its prompt), and the task, given by flag."""
HB = ["--heartbeat-interval", "1", "--peer-timeout", "10", "--metrics-port", "0"]


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env=ENV, timeout=timeout)


def _here(*args: str) -> Any:
    """A command that starts no node (run init, runs, the blob store, a join refused before its node
    starts, operator mistakes), in this process."""
    return invoke_cli(*args, env=ENV)


def _put(trainer_dir: Path, raw: bytes, tmp: Path, name: str) -> str:
    """``raw`` as a blob of the organiser's running node (published under the organiser's key)."""
    path = tmp / name
    path.write_bytes(raw)
    r = _here("blob", "put", str(path), "--data-dir", str(trainer_dir))
    assert r.returncode == 0, r.stderr
    cid: str = r.stdout.strip().splitlines()[-1]
    return cid


def _refused(tmp: Path, name: str, run: str, boot: str, *extra: str) -> str:
    """``join --run RUN`` as a participant runs it: exit 1 before a node starts; its stderr."""
    d = tmp / name
    r = _here("join", "--run", run, "--role", "worker", "--data-dir", str(d), "--headless",
              "--bootstrap", boot, *extra, *HB)
    return _exit_1(r, d)


def _refused_by_a_process(tmp: Path, name: str, run: str, boot: str) -> str:
    """:func:`_refused` by the console script: the exit code a process ends with."""
    d = tmp / name
    r = _cli("join", "--run", run, "--role", "worker", "--data-dir", str(d), "--headless",
             "--bootstrap", boot, *HB, timeout=240)
    return _exit_1(r, d)


def _exit_1(r: subprocess.CompletedProcess[str], d: Path) -> str:
    assert r.returncode == 1, (r.returncode, r.stdout[-1000:], r.stderr[-3000:])
    assert not (d / "control.json").exists()
    return r.stderr


def test_a_run_made_listed_joined_and_forgeries_refused(tmp_path: Path) -> None:
    model = build_family_model("qwen3", tmp_path / "model", shape=SHAPE)
    port = free_port()
    out = tmp_path / "run"
    given = write_config(tmp_path / "given.toml", {"rl": GIVEN_RL})
    r = _here("run", "init", "--model", str(model), "--env", RL["env"], "--env-args",
              json.dumps(RL["env_args"]), "--config", str(given), "--run-id", "qwen3-cid", "--out", str(out),
              "--calibrate-n", "16", "--batch-sizes", "1,8", "--bootstrap", f"/ip4/127.0.0.1/tcp/{port}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    cid = r.stdout.strip().splitlines()[-1]
    assert (out / "run.cid").read_text().strip() == cid
    # It says what it chose and why, and the preflight found something learnable.
    assert "rl.answer_format = 'whole' (chosen:" in r.stdout and "groups learnable" in r.stdout
    assert "sha256" in r.stdout
    organiser = load_key(out / "trainer").peer_id
    # The next steps name each node's data dir and the address a node that is not the organiser's needs.
    at = f"--bootstrap /ip4/127.0.0.1/tcp/{port}/p2p/{organiser}"
    assert f"--role trainer --data-dir {out / 'trainer'}   (serves the run)" in r.stdout
    assert f"--role validator --data-dir {out / 'validator'} {at}" in r.stdout
    assert f"participants: intellect-node join --run {cid} --role worker {at} --organiser" in r.stdout
    raw = (out / "trainer" / "runs" / f"{cid}.run").read_bytes()
    manifest = open_run_manifest(raw, organiser=organiser)
    assert manifest.run_id == "qwen3-cid" and manifest.bootstrap == [
        f"/ip4/127.0.0.1/tcp/{port}/p2p/{organiser}"]
    sections = manifest.config_dict()
    assert sections["run"]["validator_peer_ids"] == [load_key(out / "validator").peer_id]
    assert {k: sections["rl"][k] for k in RL} == RL  # what was given, and what run init chose

    procs: list[NodeProcess] = []
    boot = f"/ip4/127.0.0.1/tcp/{port}/p2p/{organiser}"
    try:
        # The two start at once: the validator's lookup of the CID retries its bootstrap dial until the
        # trainer listens.
        trainer = NodeProcess(out / "trainer", "--run", cid, "--role", "trainer",
                              "--listen", f"/ip4/127.0.0.1/tcp/{port}", *HB, env=ENV)
        procs.append(trainer)
        validator = NodeProcess(out / "validator", "--run", cid, "--role", "validator", "--bootstrap", boot,
                                *HB, env=ENV)
        procs.append(validator)
        trainer.wait_ready(180)
        # A fresh node that knows one address lists the run.
        r = _here("runs", "--bootstrap", boot, "--json", "--data-dir", str(tmp_path / "lister"))
        assert r.returncode == 0, r.stderr[-3000:]
        rows = json.loads(r.stdout)
        assert [(x["cid"], x["run_id"], x["organiser"], x["env"]) for x in rows] == [
            (cid, "qwen3-cid", organiser, "reasoning_gym:basic_arithmetic")]
        assert rows[0]["nodes"].get("trainer") == 1 and rows[0]["model"] == "model"
        # A fresh worker: a key, the run's ID (looked up among the runs listed, as above) pinned to its
        # organiser, one address.
        init_key(tmp_path / "worker")
        worker = NodeProcess(tmp_path / "worker", "--run", "qwen3-cid", "--organiser", organiser, "--role",
                             "worker", "--bootstrap", boot, *HB, env=ENV)
        procs.append(worker)

        # -- what a participant refuses, while the run trains ---------------------------------------------
        env = codec.decode(raw, Envelope, max_size=1 << 20)
        forged_payload = codec.encode(msgspec.structs.replace(manifest, bootstrap=[]))
        forged = codec.encode(msgspec.structs.replace(env, payload=forged_payload))
        mallory = SigningKey.generate()
        in_his_name = codec.encode(Envelope(domain=RUN_DOMAIN, payload=env.payload, signer=mallory.peer_id,
                                           signature=mallory.sign_bytes(RUN_DOMAIN, env.payload)))
        key = load_key(out / "trainer")
        files = [*manifest.model_files[:-1], msgspec.structs.replace(manifest.model_files[-1],
                                                                     blob=cid_of(b"nobody has this"))]
        unknown = seal_run_manifest(key, msgspec.structs.replace(manifest, model_files=files,
                                                                 created_ms=manifest.created_ms + 1))
        runs = {name: _put(out / "trainer", m, tmp_path, f"{name}.run")
                for name, m in (("forged", forged), ("mallory", in_his_name), ("unknown", unknown))}
        # A blob nobody holds is looked for a while before the lookup gives up: that one in the
        # background, as a process (the others in this process meanwhile).
        with ThreadPoolExecutor(1) as pool:
            gave_up = pool.submit(_refused_by_a_process, tmp_path, "j-unknown", runs["unknown"], boot)

            got = {"forged": _refused(tmp_path, "j-forged", runs["forged"], boot),
                   "mallory": _refused(tmp_path, "j-mallory", runs["mallory"], boot),
                   "other-organiser": _refused(tmp_path, "j-other-organiser", cid, boot, "--organiser",
                                               mallory.peer_id)}
            assert "bad signature" in got["forged"], got["forged"]
            assert "not its signer" in got["mallory"], got["mallory"]
            assert f"not by the organiser {mallory.peer_id}" in got["other-organiser"], got["other-organiser"]
            # Operator mistakes: exit 2 naming the flag, before anything is started.
            r = _here("join", "--run", cid, "--run-id", "other", "--data-dir", str(tmp_path / "j-flag"),
                      "--bootstrap", boot)
            assert r.returncode == 2, r.stderr
            assert "run.run_id (set in --run-id) comes from the run manifest" in r.stderr
            r = _here("join", "--run", cid, "--organiser", "nobody", "--data-dir", str(tmp_path / "j-flag2"))
            assert r.returncode == 2 and "--organiser 'nobody' is not a peer ID" in r.stderr

            # -- the run trains: the worker gets batches accepted and follows the trainer's steps ----------
            worker.wait_ready(240)
            wait_for(lambda: worker.status()["worker"]["accepted"] >= 1, timeout=400, what="a batch accepted")
            fetched = tmp_path / "worker" / "runs" / cid / "model"
            assert sorted(p.name for p in fetched.iterdir()) == sorted(f.path for f in manifest.model_files)
            for f in manifest.model_files:
                assert (fetched / f.path).read_bytes() == (model / f.path).read_bytes()
            wait_for(lambda: len(trained(out / "trainer")) >= STEPS, timeout=400,
                     what=f"{STEPS} trained steps")
            # The worker follows: it loads a version the trainer published after the first step.
            wait_for(lambda: worker.status()["worker"]["policy_version"] >= STEPS - 1, timeout=120,
                     what="the worker on a new policy")
            wait_for(lambda: worker.status()["worker"]["accepted"] >= 2, timeout=120,
                     what="verdicts back at the worker")
            # The worker records the problems it draws per version when it draws them: a moment after it
            # loaded the version (status above), so wait for the record too.
            used_file = tmp_path / "worker" / "worker" / "used.json"
            wait_for(lambda: drawn_for_a_new_version(used_file), timeout=120,
                     what="the worker drawing problems for a new version")
            tstat = trainer.status()["trainer"]
            vstat = validator.status()["validator"]
            wstat = worker.status()["worker"]
            unknown_blob = gave_up.result()
        assert f"could not fetch blob {cid_of(b'nobody has this')}" in unknown_blob, unknown_blob
    finally:
        for p in procs:
            p.close()
    check_run(out / "trainer", tstat, vstat, wstat, json.loads(used_file.read_text()),
              group_size=RL["group_size"])


def test_run_publish_serves_a_run_without_a_role(tmp_path: Path) -> None:
    """`run publish` on the organiser's data dir: a node with no role lists the run, which a fresh node
    then finds, `runs` beside the running node finds through that node, and a data dir that remembers
    the node's address finds without --bootstrap; thresholds given (`--thresholds`) instead of
    calibrated."""
    from intellect_node.models.loader import embedded_model_dir

    model = embedded_model_dir()
    out = tmp_path / "run"
    organiser = init_key(tmp_path / "organiser").peer_id  # the run's trainer too: its feed is trusted
    r = _here("run", "init", "--model", str(model), "--run-id", "embedded", "--out", str(out), "--thresholds",
              str(model / "proof_thresholds.json"), "--trainer-peer-id", organiser,
              "--data-dir", str(tmp_path / "organiser"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    cid = r.stdout.strip().splitlines()[-1]
    assert f"run publish --data-dir {tmp_path / 'organiser'}" in r.stdout and "(given)" in r.stdout
    # The run's blobs are pinned: `blob gc` leaves the manifest and every model file.
    r = _here("blob", "gc", "--min-age", "0", "--data-dir", str(tmp_path / "organiser"))
    assert r.returncode == 0 and "removed 0 blob(s)" in r.stderr, r.stderr
    r = _here("blob", "ls", "--json", "--data-dir", str(tmp_path / "organiser"))
    held = {b["cid"]: b["pinned"] for b in map(json.loads, r.stdout.splitlines())}
    assert held[cid] == "run embedded: its manifest" and all(held.values())
    assert len(held) == len(list(model.iterdir()))  # the manifest, and the files but the thresholds
    # What a trainer and an evaluating validator of the run would have written, in the organiser's data
    # dir: its node serves them as its signed feed, which `run report --run` draws.
    steps = [{"step": i, "version": i + 1, "trained": True, "pass_rate": i / 10, "reward_mean": i / 10,
              "kl_sampler": 0.01} for i in range(5)]
    held_out = [{"version": v, "n": 64, "pass_rate": v / 20, "mean_reward": v / 20, "evaluator": organiser}
            for v in (0, 5)]
    for rel, lines in (("trainer/metrics.jsonl", steps), ("validator/held_out.jsonl", held_out)):
        (tmp_path / "organiser" / rel).parent.mkdir(exist_ok=True)
        (tmp_path / "organiser" / rel).write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"torn')
    port = free_port()
    publisher = NodeProcess(tmp_path / "organiser", env=ENV, argv=[
        CLI, "run", "publish", "--data-dir", str(tmp_path / "organiser"), "--listen",
        f"/ip4/127.0.0.1/tcp/{port}", "--log-file", str(tmp_path / "publisher.log")])
    try:
        st = publisher.wait_ready(180)
        assert st["runs"]["runs"][0]["cid"] == cid
        r = _here("runs", "--bootstrap", st["listen_addrs"][0], "--json", "--data-dir", str(tmp_path / "l"))
        assert r.returncode == 0, r.stderr[-3000:]
        rows = json.loads(r.stdout)
        assert [(x["cid"], x["run_id"], x["nodes"]) for x in rows] == [(cid, "embedded", {"node": 1})]
        # Beside the running node, `runs` needs no address: it asks that node (its control API), which
        # looks through its own swarm and counts its own listing.
        r = _here("runs", "--json", "--data-dir", str(tmp_path / "organiser"))
        assert r.returncode == 0, r.stderr[-3000:]
        assert [(x["cid"], x["run_id"]) for x in json.loads(r.stdout)] == [(cid, "embedded")]
        # With no node running and no address given, the peers a data dir remembers are asked.
        remembered = tmp_path / "rem"
        remembered.mkdir()
        book = PeerBook("", data_dir=remembered)
        addr = st["listen_addrs"][0]
        book.remember(addr.rsplit("/p2p/", 1)[1], [addr])
        book.save(force=True)
        r = _here("runs", "--json", "--data-dir", str(remembered))
        assert r.returncode == 0, r.stderr[-3000:]
        assert [x["cid"] for x in json.loads(r.stdout)] == [cid]
        # A report of the run from the swarm: the trainer's signed feed, fetched by a fresh node.
        page = tmp_path / "report.html"
        r = _here("run", "report", "--run", cid, "--bootstrap", addr, "--out", str(page))
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        assert "(5 steps," in r.stdout and "2 held-out results" in r.stdout, r.stdout
        text = page.read_text()
        assert "intellect-node run report: embedded" in text and "Held-out evaluation" in text
    finally:
        publisher.close()
