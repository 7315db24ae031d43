"""``intellect-node status``: ask the node running with a data dir what it is doing.

Talks to the node's control API (``<data-dir>/control.json``). Exits 2 with a hint when no node runs
there. ``--json`` prints the control API's answer unchanged: at least ``peer_id``, ``listen_addrs``
(full multiaddrs with ``/p2p/<id>``), ``peers`` (connected peer IDs), ``health`` (``state``: running or
degraded, ``reasons``, ``restarts``, recent ``warnings``) and the full ``snapshot``. The summary puts
the state and its reasons first: a degraded node must not read as a healthy one; then what to hand to
others (the listen multiaddrs) and the metrics URL to scrape (``metrics.metrics`` in the JSON). A trainer
that is not learning (``snapshot.training.no_signal_warning``) says so right under the state, and its
step attempts are on the ``training`` line. The run's audit state (``snapshot.audits``) follows: a
failed audit as ``AUDIT FAILED`` with its step, both hashes and whether the node still follows the
trainer; otherwise the counts, ``UNAUDITED`` when no verdict was heard. A validator of a run with held-out
evaluation shows the newest result (``snapshot.held_out``): version, pass rate, mean reward, problems,
its evaluator, and the results confirmed and refused here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

import typer

from intellect_node.commands.common import DataDirOption, data_dir
from intellect_node.node import control

TIMELINE_LABELS = (("ready", "ready"), ("first_peer", "peer"), ("first_policy", "policy"),
                   ("first_batch_submitted", "batch submitted"), ("first_batch_accepted", "accepted"))
"""``snapshot.timeline``'s stages (config/status.py TIMELINE_STAGES) as the summary names them."""


def audit_lines(a: dict[str, Any]) -> list[str]:
    """The run's audit state (``snapshot.audits``): a failed audit first and loud, with its evidence in
    short; steps that could not be audited are never read as passed, and no verdict is ``unaudited``."""
    state = a.get("state", "unaudited")
    age = a.get("last_verdict_age_s")
    counts = (f"{a.get('audited', 0)} steps audited: {a.get('passed', 0)} passed, "
              f"{a.get('failed', 0)} failed, {a.get('unavailable', 0)} unavailable"
              + (f" · last verdict {age:.0f} s ago" if isinstance(age, (int, float)) else ""))
    f = a.get("first_failed") or {}
    if state == "failed" and f:
        return [f"AUDIT FAILED step {f.get('seq')} (v{f.get('version')}) by {f.get('auditor')}: "
                + ("NOT FOLLOWING THE TRAINER" if a.get("refusing") else "still following the trainer "
                   "(run.require_audits off)"),
                f"            replay made {f.get('expected') or '-'}",
                f"            published   {f.get('published')}",
                f"            {f.get('reason', '')}",
                f"audits      {counts}", *coverage_lines(a)]
    label = state.upper() if state in ("unaudited", "partial") else state
    lines = [f"audits      {label} · {counts}" + (f" ({a['detail']})" if a.get("detail") else "")]
    return lines + coverage_lines(a)


def coverage_lines(a: Mapping[str, object]) -> list[str]:
    """The audit coverage (``run.audit_checkpoint_every``): one line, loud when low; none with no rule."""
    state = a.get("coverage", "off")
    if state == "off":
        return []
    rule = f"gap {a.get('coverage_gap', 0)} of {a.get('checkpoint_every', 0)} steps"
    if state == "low":
        return [f"coverage    AUDIT COVERAGE LOW · {rule}: {a.get('coverage_detail', '')}"
                + (" · NOT FOLLOWING THE TRAINER" if a.get("required") else "")]
    return [f"coverage    ok · {rule}"]


def held_out_line(h: dict[str, Any]) -> list[str]:
    """The newest held-out evaluation (``snapshot.held_out``, validators of a run with evaluation on): its
    figures and who produced them, and how the results heard fared here; nothing before any was heard."""
    if not h.get("at"):
        return []
    checks = f"{h.get('confirmed', 0)} confirmed, {h.get('refused', 0)} refused here"
    if h.get("version", -1) < 0:
        return [f"held-out    none taken · {checks}"]
    return [f"held-out    v{h['version']}: pass rate {h.get('pass_rate', 0):.3f}, mean reward "
            f"{h.get('mean_reward', 0):.3f} over {h.get('n', 0)} problems, by {h.get('evaluator', '?')} "
            f"· {checks}"]


def summary(st: dict[str, Any]) -> str:
    """A readable multi-line summary of a status answer."""
    health = st.get("health") or {}
    state = health.get("state", "?")
    lines = [f"state       {state.upper() if state not in ('running', '?') else state}"
             + "".join(f"\n            - {r}" for r in health.get("reasons") or [])]
    training = (st.get("snapshot") or {}).get("training") or {}
    if training.get("no_signal_warning"):
        lines.append(f"NOT LEARNING {training['no_signal_warning']}")
    lines += audit_lines((st.get("snapshot") or {}).get("audits") or {})
    lines += held_out_line((st.get("snapshot") or {}).get("held_out") or {})
    restarts = {k: v for k, v in (health.get("restarts") or {}).items() if v}
    if restarts:
        lines.append("restarts    " + ", ".join(f"{k} {v}" for k, v in sorted(restarts.items())))
    lines += [f"peer id     {st.get('peer_id', '?')}",
              f"run         {st.get('run_id', '?')}   roles: {', '.join(st.get('roles') or []) or '-'}",
              f"http        {st.get('http_url') or '-'}",
              f"metrics     {(st.get('metrics') or {}).get('metrics') or 'off'}"]
    addrs = st.get("listen_addrs") or []
    lines.append("listening   " + ("\n            ".join(addrs) if addrs else "-"))
    nat = st.get("nat") or {}
    if nat:  # docs/nat.md: AutoNAT's verdict and what to do about it
        relays = ", ".join(r.get("relay", "?")[:16] for r in nat.get("relays") or [])
        lines.append(f"reachable   {nat.get('reachability', '?')}"
                     + (f" via relay {relays}" if relays else "")
                     + f"\n            {nat.get('fix', '')}")
    peers = st.get("peers") or []
    alive = set(st.get("alive_peers") or [])
    lines.append(f"connected   {len(peers)} peer(s), {len(alive)} alive by heartbeat")
    for rec in st.get("known_peers") or []:
        flags = [rec.get("state", "?")]
        if rec.get("connected"):
            flags.append("connected")
        if rec.get("banned"):
            flags.append(f"BANNED ({rec['banned']})")
        if rec.get("rejections"):
            flags.append(f"{rec['rejections']} rejected (last: {rec.get('last_rejection')})")
        lines.append(f"  {rec.get('peer_id')}  {', '.join(flags)}  {rec.get('http_url') or ''}".rstrip())
    timeline = (st.get("snapshot") or {}).get("timeline") or {}
    reached = [f"{label} {timeline[stage]:.1f} s" for stage, label in TIMELINE_LABELS
               if isinstance(timeline.get(stage), (int, float))]
    if reached:  # config/status.py: the join's stages, seconds from the process's start
        lines.append("timeline    " + " · ".join(reached) + "  (since process start)")
    if training.get("attempts"):  # config/status.py: a trainer's step attempts, trained or not
        causes = ", ".join(f"{k} {v}" for k, v in sorted((training.get("no_signal_causes") or {}).items()))
        frac = training.get("filtered_fraction")
        lines.append(f"training    step {training.get('step', -1)} · {training['attempts']} attempts, "
                     f"{training.get('no_signal_attempts', 0)} with no learnable group"
                     + (f" ({causes})" if causes else "")
                     + (f" · last filtered {frac:.0%} of groups" if isinstance(frac, (int, float)) else ""))
    warnings = health.get("warnings") or []
    if warnings:
        lines.append(f"warnings    {len(warnings)} recent (newest last)")
        lines += [f"  {w}" for w in warnings[-5:]]
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    @app.command("status")
    def status(
        data_dir_opt: Optional[Path] = DataDirOption,
        as_json: bool = typer.Option(False, "--json", help="Print the node's status as one JSON object."),
        timeout: float = typer.Option(10.0, "--timeout", min=0.1, help="Seconds to wait for the node."),
    ) -> None:
        """Show the running node's peer ID, addresses and peers (needs `intellect-node join` running)."""
        st = control.request(data_dir(data_dir_opt), "GET", "/v1/status", timeout=timeout)
        typer.echo(json.dumps(st) if as_json else summary(st))
