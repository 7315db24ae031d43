"""Prometheus metrics, exported from the node's :class:`~intellect_node.config.status.StatusBoard`.

There is no second set of counters: a custom collector reads one snapshot per scrape, so ``/metrics``,
the JSON status and the dashboard can never disagree. Each node gets its own ``CollectorRegistry``
(several nodes share a process in tests; the global default registry would mix them).

Metric names follow Prometheus conventions (``_total`` counters, base units: bytes, seconds).

:class:`MetricsService` is the runtime service (``config.metrics``) that serves ``GET /metrics`` and a
token-free, read-only ``GET /v1/status`` (the snapshot JSON) on its own port, by default on 127.0.0.1.
It has its own port rather than a route on the control API because a Prometheus scrape config needs a
fixed port and no token, while the control API's port is random and every route on it needs the token.
``GET /v1/health`` there answers 200 for a healthy node and 503 (with the reasons) otherwise, for load
balancers and health checks that read status codes.

The port is fixed by default, :data:`DEFAULT_PORT` (29464), because a scrape config names one. Why that
number: Prometheus' exporter range 9100-9999 is fully allocated (9464 there is OpenTelemetry's exporter),
29464 is in no ``/etc/services`` list, and it sits below Linux' ephemeral range (32768-60999), so an
outgoing connection never holds it. A port the operator chose that is taken stops the node with a message
naming ``--metrics-port``; the default port taken (a second node on the machine) falls back to a free port
and says so, since the demo and local sweeps run several nodes side by side.

Besides the node's own numbers the registry carries prometheus_client's ``process_*`` (CPU, memory, open
files), ``python_info`` and ``python_gc_*`` collectors, as a Python exporter is expected to.

Health on a scrape: ``intellect_node_healthy`` is 1 only for a running node without degraded reasons,
``intellect_node_restarts_total{part}`` counts libp2p and essential-task restarts, and
``intellect_node_status_age_seconds`` is how long ago the node's status loop last refreshed the board
(alert when it passes a few seconds: the numbers beside it are stale).

Held-out evaluation (validators of a run with ``run.eval_every``): ``intellect_node_held_out_version``,
``_problems``, ``_pass_rate`` and ``_mean_reward``, each labelled ``{evaluator}``, and
``intellect_node_held_out_results_total{outcome}`` (confirmed, refused).

Audits (every node of a run): ``intellect_node_audit_state{state}``, ``intellect_node_audit_steps{outcome}``,
``intellect_node_auditors{which}``, ``intellect_node_audit_refusing``, and once there is one
``intellect_node_audit_first_failed_seq`` and ``intellect_node_audit_last_verdict_age_seconds``; the
audit coverage (``run.audit_checkpoint_every``): ``intellect_node_audit_coverage{state}`` (ok, low, off)
and ``intellect_node_audit_coverage_gap_steps``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterator

from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from intellect_node.config.status import AUDIT_STATES, NO_SIGNAL_CAUSES, StatusBoard, StatusSnapshot, Training

if TYPE_CHECKING:
    from intellect_node.node.runtime import NodeRuntime

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_PORT = 29464
"""The documented default metrics port (why this number: the module docstring)."""
_PREFIX = "intellect_node"


class StatusCollector(Collector):
    def __init__(self, board: StatusBoard) -> None:
        self._board = board

    def collect(self) -> Iterator[Metric]:
        s = self._board.snapshot()
        info = InfoMetricFamily(f"{_PREFIX}_node", "Node identity and role.")
        info.add_metric([], {"peer_id": s.identity.peer_id, "role": s.role, "run_id": s.run.run_id,
                             "version": s.identity.version, "state": s.state})
        yield info

        peers = GaugeMetricFamily(f"{_PREFIX}_peers", "Connected peers, by the role they announce.",
                                  labels=["role"])
        peers.add_metric(["any"], s.peers.count)
        peers.add_metric(["trainer"], len(s.peers.trainers))
        peers.add_metric(["validator"], len(s.peers.validators))
        peers.add_metric(["worker"], len(s.peers.workers))
        yield peers
        inbound = GaugeMetricFamily(f"{_PREFIX}_inbound_slots",
                                    "Inbound connection slots: held by open inbound connections (in_use) and "
                                    "the cap past which new inbound connections are refused (cap).",
                                    labels=["which"])
        inbound.add_metric(["in_use"], s.peers.inbound_in_use)
        inbound.add_metric(["cap"], s.peers.inbound_cap)
        yield inbound
        yield CounterMetricFamily(f"{_PREFIX}_inbound_refused", "Inbound connections refused because the "
                                  "inbound cap was full.", value=s.peers.inbound_refused)
        gossip = CounterMetricFamily(f"{_PREFIX}_gossip_undelivered",
                                     "Gossip messages not delivered: refused (blamed on their origin), or "
                                     "ignored as stale or as a repeat (replays: blamed on no one).",
                                     labels=["outcome"])
        gossip.add_metric(["refused"], s.peers.gossip_refused)
        gossip.add_metric(["ignored_stale"], s.peers.gossip_ignored_stale)
        gossip.add_metric(["ignored_repeat"], s.peers.gossip_ignored_repeat)
        yield gossip

        policy = GaugeMetricFamily(f"{_PREFIX}_policy_version",
                                   "Policy version: newest announced (current) and loaded here (local).",
                                   labels=["which"])
        policy.add_metric(["current"], s.policy.current)
        policy.add_metric(["local"], s.policy.local)
        yield policy
        yield GaugeMetricFamily(f"{_PREFIX}_policy_staleness_steps",
                                "Trainer steps the local policy lags the newest announced one.",
                                value=s.policy.staleness)

        rollouts = CounterMetricFamily(f"{_PREFIX}_rollouts",
                                       "Rollouts by outcome: generated, submitted, accepted, rejected.",
                                       labels=["verdict"])
        for name in ("generated", "submitted", "accepted", "rejected"):
            rollouts.add_metric([name], getattr(s.rollouts, name))
        yield rollouts

        yield GaugeMetricFamily(f"{_PREFIX}_tokens_per_second",
                                "Generated tokens per second over the last 30 s.",
                                value=s.throughput.tokens_per_s)
        yield CounterMetricFamily(f"{_PREFIX}_tokens_generated", "Tokens generated.",
                                  value=s.throughput.tokens_total)
        yield CounterMetricFamily(f"{_PREFIX}_shard_bytes_downloaded", "Weight-shard bytes downloaded.",
                                  value=s.shards.bytes_downloaded)
        yield GaugeMetricFamily(f"{_PREFIX}_shard_downloads_active", "Shard downloads in progress.",
                                value=len(s.shards.active))

        yield CounterMetricFamily(f"{_PREFIX}_proofs_checked", "Rollout proofs checked by this node.",
                                  value=s.proofs.checked)
        failures = CounterMetricFamily(f"{_PREFIX}_proof_failures", "Proof checks failed, by reason.",
                                       labels=["reason"])
        for reason, n in sorted(s.proofs.failures_by_reason.items()):
            failures.add_metric([reason], n)
        yield failures

        yield GaugeMetricFamily(f"{_PREFIX}_train_step", "Last trainer step seen.", value=s.training.step)
        if s.training.history:
            last = s.training.history[-1]
            yield GaugeMetricFamily(f"{_PREFIX}_reward_mean", "Mean reward at the last step.",
                                    value=last.reward_mean)
            yield GaugeMetricFamily(f"{_PREFIX}_pass_rate", "Pass rate at the last step.",
                                    value=last.pass_rate)
        yield from _learning_signal(s.training)
        yield from _step_sizes(s.training)
        yield from _audits(s)
        yield from _held_out(s)
        yield GaugeMetricFamily(f"{_PREFIX}_uptime_seconds", "Seconds since the node started.",
                                value=s.uptime_s)
        # The join timeline: a stage appears once reached (a validator never submits a batch), so an
        # alert on absent(...) or a threshold reads "not reached" apart from "reached late".
        timeline = GaugeMetricFamily(f"{_PREFIX}_timeline_seconds",
                                     "Seconds from process start to the first time each join stage was "
                                     "reached (ready, first_peer, first_policy, first_batch_submitted, "
                                     "first_batch_accepted).", labels=["stage"])
        for stage, since in s.timeline.stages():
            if since is not None:
                timeline.add_metric([stage], since)
        yield timeline

        yield GaugeMetricFamily(f"{_PREFIX}_healthy", "1 if the node runs with no degraded reason, else 0.",
                                value=int(s.healthy))
        restarts = CounterMetricFamily(f"{_PREFIX}_restarts",
                                       "Restarts of a part of the node since it started.", labels=["part"])
        for part in ("libp2p", "tasks"):
            restarts.add_metric([part], s.health.restarts.get(part, 0))
        yield restarts
        yield GaugeMetricFamily(f"{_PREFIX}_status_age_seconds",
                                "Seconds since the node's status loop last refreshed its numbers.",
                                value=s.age_s)
        yield GaugeMetricFamily(f"{_PREFIX}_warnings_recent",
                                "Warnings among the recent ones kept in the status.", value=len(s.warnings))


def _step_sizes(t: Training) -> Iterator[Metric]:
    """The last trained step's sizes (``config/status.StepDiagnostics``), once there was one, and whether
    the status carries the step-too-large warning (0 on other roles)."""
    yield GaugeMetricFamily(f"{_PREFIX}_step_too_large",
                            "1 while the status carries the step-too-large warning, else 0.",
                            value=int(bool(t.step_warning)))
    d = t.diagnostics
    if d is None:
        return
    for name, value, what in (
            ("step_kl_sampler", d.kl_sampler, "KL(sampler || current) per token at the last step, nats."),
            ("step_clipped_fraction", d.clipped_frac, "Fraction of the last step's tokens cut (clip, mask)."),
            ("step_ratio_mean", d.ratio_mean, "Mean importance ratio to the sampler at the last step."),
            ("step_ratio_max", d.ratio_max, "Largest importance ratio to the sampler at the last step."),
            ("step_grad_norm", d.grad_norm, "Gradient norm of the last step, before clipping."),
            ("step_lr", d.lr, "Learning rate of the last step."),
            ("step_entropy", d.entropy, "Mean -log pi(token) at the last step (entropy estimate), nats."),
            ("step_staleness_max", d.staleness_max, "Versions behind of the last step's oldest sample.")):
        yield GaugeMetricFamily(f"{_PREFIX}_{name}", what, value=value)


def _learning_signal(t: Training) -> Iterator[Metric]:
    """The trainer's step attempts and the online filter (``config/status.py``, "Learning signal"): zeros
    on other roles, so one alert rule fits every node."""
    yield CounterMetricFamily(f"{_PREFIX}_train_attempts",
                              "Step attempts: batches taken for a step, trained on or not.", value=t.attempts)
    no_signal = CounterMetricFamily(f"{_PREFIX}_train_attempts_no_signal",
                                    "Step attempts with no learnable group (every group's rewards equal), "
                                    "by cause.", labels=["cause"])
    for cause in NO_SIGNAL_CAUSES:
        no_signal.add_metric([cause], t.no_signal_causes.get(cause, 0))
    yield no_signal
    yield GaugeMetricFamily(f"{_PREFIX}_no_signal_streak",
                            "The newest step attempts in a row with no learnable group.",
                            value=t.no_signal_streak)
    yield GaugeMetricFamily(f"{_PREFIX}_not_learning",
                            "1 while the status carries the no-learnable-group warning, else 0.",
                            value=int(bool(t.no_signal_warning)))
    groups = CounterMetricFamily(f"{_PREFIX}_train_groups",
                                 "Groups in step attempts: seen, and filtered (rewards all equal).",
                                 labels=["outcome"])
    groups.add_metric(["seen"], t.groups_seen)
    groups.add_metric(["filtered"], t.groups_filtered)
    yield groups
    if t.filtered_fraction is not None:
        yield GaugeMetricFamily(f"{_PREFIX}_groups_filtered_fraction",
                                "Fraction of the last step attempt's groups dropped by the online filter.",
                                value=t.filtered_fraction)


def _audits(s: StatusSnapshot) -> Iterator[Metric]:
    """The run's audit state (``roles/common/audits.py``) as every node sees it: one alert rule fits
    every node. The step counts are gauges: a step first ``unavailable`` moves when an auditor passes or
    fails it later."""
    a = s.audits
    state = GaugeMetricFamily(f"{_PREFIX}_audit_state",
                              "The run's audit state: 1 for the current one (unaudited: no verdict heard; "
                              "partial: some steps could not be audited, none failed).", labels=["state"])
    for name in AUDIT_STATES:
        state.add_metric([name], int(a.state == name))
    yield state
    steps = GaugeMetricFamily(f"{_PREFIX}_audit_steps",
                              "Trainer steps audited, by outcome over the run's auditors (failed if any "
                              "failed it, passed if any passed it, else unavailable).", labels=["outcome"])
    for outcome in ("passed", "failed", "unavailable"):
        steps.add_metric([outcome], getattr(a, outcome))
    yield steps
    auditors = GaugeMetricFamily(f"{_PREFIX}_auditors", "The run's auditors: accepted by this node, and "
                                 "heard from.", labels=["which"])
    auditors.add_metric(["accepted"], a.auditors)
    auditors.add_metric(["heard"], a.heard_from)
    yield auditors
    yield GaugeMetricFamily(f"{_PREFIX}_audit_refusing",
                            "1 while this node refuses the run's trainer after a failed audit or "
                            "while its audit coverage is low (run.require_audits), else 0.",
                            value=int(a.refusing))
    coverage = GaugeMetricFamily(f"{_PREFIX}_audit_coverage",
                                 "The run's audit coverage (run.audit_checkpoint_every): 1 for the current "
                                 "state (low: too many steps without a checkpoint state, or starts the "
                                 "auditors could not fetch; off: no rule).", labels=["state"])
    for name in ("ok", "low", "off"):
        coverage.add_metric([name], int(a.coverage == name))
    yield coverage
    yield GaugeMetricFamily(f"{_PREFIX}_audit_coverage_gap_steps",
                            "Trained steps heard since the trainer's newest checkpoint state heard.",
                            value=a.coverage_gap)
    if a.first_failed is not None:
        yield GaugeMetricFamily(f"{_PREFIX}_audit_first_failed_seq",
                                "Journal sequence number of the first step an auditor failed.",
                                value=a.first_failed.seq)
    age = s.audit_age_s
    if age is not None:  # absent until a verdict is heard: absent() reads "never audited"
        yield GaugeMetricFamily(f"{_PREFIX}_audit_last_verdict_age_seconds",
                                "Seconds since the newest audit verdict this node accepted.", value=age)


def _held_out(s: StatusSnapshot) -> Iterator[Metric]:
    """The newest held-out evaluation a validator took (``roles/validator/evals.py``), labelled with the
    peer that evaluated it; the results' re-check counts once any was heard."""
    h = s.held_out
    if h.version >= 0:
        labels = ["evaluator"]
        for name, what, value in (("version", "Policy version of the newest held-out evaluation.", h.version),
                                  ("problems", "Held-out problems it evaluated.", h.n),
                                  ("pass_rate", "Its pass rate (share of problems with full credit).",
                                   h.pass_rate),
                                  ("mean_reward", "Its mean reward.", h.mean_reward)):
            g = GaugeMetricFamily(f"{_PREFIX}_held_out_{name}", what, labels=labels)
            g.add_metric([h.evaluator], value)
            yield g
    if h.at:
        checks = CounterMetricFamily(f"{_PREFIX}_held_out_results", "Held-out results of other nodes "
                                     "re-checked here and confirmed, and refused (recorded against their "
                                     "evaluator).", labels=["outcome"])
        checks.add_metric(["confirmed"], h.confirmed)
        checks.add_metric(["refused"], h.refused)
        yield checks


def build_registry(board: StatusBoard) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(board))
    # Per registry, not the global default one: several nodes share a process in tests.
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def metrics_routes(board: StatusBoard) -> list[web.RouteDef]:
    """``GET /metrics`` for the runtime's aiohttp app (bound to 127.0.0.1; no token, like node_exporter)."""
    registry = build_registry(board)

    async def handle(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE})

    return [web.get("/metrics", handle)]


def status_routes(board: StatusBoard) -> list[web.RouteDef]:
    """``GET /v1/status``: the snapshot JSON (what the dashboard renders), without a token;
    ``GET /v1/health``: 200 if healthy, else 503, with the state and the reasons."""
    async def handle(_request: web.Request) -> web.Response:
        return web.Response(body=board.snapshot().to_json(), content_type="application/json")

    async def health(_request: web.Request) -> web.Response:
        s = board.snapshot()
        return web.json_response({"state": s.state, "healthy": s.healthy, "reasons": list(s.health.reasons),
                                  "age_s": round(s.age_s, 3)}, status=200 if s.healthy else 503)

    return [web.get("/v1/status", handle), web.get("/v1/health", health)]


class MetricsService:
    """A node service (see ``node/runtime.py``): serves :func:`metrics_routes` and :func:`status_routes`
    on ``host:port``. Build with ``MetricsService.for_runtime`` as the runtime's service factory."""

    name = "metrics"

    def __init__(self, board: StatusBoard, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 port_chosen: bool = True) -> None:
        self.board = board
        self.host = host
        self.port = port
        self.port_chosen = port_chosen  # False: the default port, which may fall back to a free one
        self.url = ""
        self._runner: web.AppRunner | None = None

    @classmethod
    def for_runtime(cls, rt: NodeRuntime) -> "MetricsService":
        cfg = rt.config.metrics
        return cls(rt.board, host=cfg.host, port=cfg.port, port_chosen="port" in cfg.model_fields_set)

    async def start(self) -> None:
        from intellect_node.errors import ConfigError

        app = web.Application()
        app.add_routes(metrics_routes(self.board) + status_routes(self.board))
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, shutdown_timeout=1.0)
        try:
            await site.start()
        except OSError as exc:
            if self.port_chosen or self.port == 0:
                await runner.cleanup()
                raise ConfigError(f"cannot serve metrics on {self.host}:{self.port} ({exc.strerror}): "
                                  "another program holds the port; pass --metrics-port with a free port "
                                  "(0: any), or set metrics.port / metrics.enabled = false",
                                  field="metrics.port") from exc
            log.info("metrics port %d is taken (another node on this machine?); using a free port instead. "
                     "Pass --metrics-port for a fixed scrape target", self.port)
            site = web.TCPSite(runner, self.host, 0, shutdown_timeout=1.0)
            await site.start()
        self._runner = runner
        sock = site._server.sockets[0]  # type: ignore[union-attr]  # the bound port when port=0
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
        self.board.set_metrics_url(f"{self.url}/metrics")
        log.info("metrics on %s/metrics", self.url)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def status(self) -> dict[str, str]:
        return {"url": self.url, "metrics": f"{self.url}/metrics" if self.url else ""}
