# SPDX-License-Identifier: Apache-2.0
"""What the F5, F6, W1, W3 and W4 reproductions share: vLLM's KVCacheManager with the Scheduler attributes
its chunk-clipping methods read (:func:`build`), and one request served on it as Scheduler.schedule /
update_from_output serve a request alone (:func:`serve`).

Needs only vLLM 0.32.0 or 0.33.0, like the scripts that import it: each script puts its own directory first on
``sys.path`` when run as ``python docs/repro/wN_....py``, so ``from first_repeat import ...`` finds this
file without installing anything. Lookahead block hashes (``L > 0``) exist in vLLM 0.33.0 only:
:func:`lookahead_kwargs`.
"""

import inspect
import types

import vllm
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.request import Request, RequestStatus


def has_lookahead_hashes():
    """vLLM 0.33.0's KVCacheManager and get_request_block_hasher take num_hash_lookahead_tokens; 0.32.0's do not."""
    return all("num_hash_lookahead_tokens" in inspect.signature(fn).parameters
               for fn in (KVCacheManager, get_request_block_hasher))


def lookahead_kwargs(fn, L):
    """``num_hash_lookahead_tokens=L`` for ``fn`` (KVCacheManager, get_request_block_hasher) where the installed
    vLLM has lookahead block hashes (0.33.0); vLLM 0.32.0 has none, so there only ``L = 0`` can be built."""
    if "num_hash_lookahead_tokens" in inspect.signature(fn).parameters:
        return {"num_hash_lookahead_tokens": L}
    if L:
        raise SystemExit(f"vLLM {vllm.__version__} has no lookahead block hashes ({fn.__name__} takes no "
                         f"num_hash_lookahead_tokens): L = {L} needs vLLM 0.33.0")
    return {}


def build(groups, *, S, H, use_eagle, L, Lp, k, retention, max_model_len, num_blocks, dcp=1, budget=10**6):
    """A real KVCacheManager plus the Scheduler attributes its chunk-clipping methods read (``budget``:
    SchedulerConfig.max_num_batched_tokens, the most a prefill chunk schedules in one step)."""
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], spec, is_eagle_group=eagle)
                                         for i, (spec, eagle) in enumerate(groups)],
                        prefix_cache_retention_interval=retention)
    mgr = KVCacheManager(kv_cache_config=cfg, max_model_len=max_model_len, scheduler_block_size=S,
                         hash_block_size=H, enable_caching=True, use_eagle=use_eagle,
                         num_prefill_lookahead=Lp, dcp_world_size=dcp, pcp_world_size=1,
                         **lookahead_kwargs(KVCacheManager, L))
    mamba = [spec for spec, _ in groups if isinstance(spec, MambaSpec)]
    partial = bool(mamba) and H < S and mgr.coordinator.enable_partial_hash_hits
    # What Scheduler.__init__ sets (0.33.0 scheduler.py:295-464); 0.32.0's read all but num_hash_lookahead_tokens.
    sched = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(block_size=min(spec.block_size for spec, _ in groups),
                                           mamba_cache_mode="align" if mamba else "none"),
        block_size=S, hash_block_size=H, use_eagle_block_drop=use_eagle, num_hash_lookahead_tokens=L,
        num_prefill_lookahead=Lp, need_mamba_block_aligned_split=bool(mamba),
        mamba_prefill_checkpoint_alignment=mamba[0].prefill_checkpoint_alignment if mamba else None,
        mamba_has_prefill_checkpoint_blocks=bool(mamba) and all(m.num_prefill_checkpoint_blocks > 0 for m in mamba),
        mamba_partial_cache_hit=partial, mamba_shared_prefix_checkpoint=partial and mgr.mamba_shared_prefix_checkpoint,
        max_num_scheduled_tokens=budget, scheduler_config=types.SimpleNamespace(long_prefill_token_threshold=0),
        kv_cache_manager=mgr)
    return mgr, sched, get_request_block_hasher(H, sha256, **lookahead_kwargs(get_request_block_hasher, L))


def serve(mgr, sched, hasher, prompt, k, rid):
    """One request as Scheduler.schedule / update_from_output run it alone: admission lookup, prefill chunks
    of at most the token budget, clipped by the scheduler's own Mamba split and prefill-lookahead
    reservation (allocate_slots caches at schedule time), one sampled token (re-cached with a drafter,
    0.33.0 scheduler.py:2404-2415; 0.32.0's update_from_output has no such call, which changes no number the
    scripts print), free. Returns the admission hit."""
    req = Request(rid, prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    mgr.new_step_starts()
    blocks, hit, spb = mgr.get_computed_blocks(req)
    req.shared_prefix_boundary = spb
    computed, first = hit, True
    while computed < req.num_tokens:
        n = min(req.num_tokens - computed, sched.max_num_scheduled_tokens)
        if sched.need_mamba_block_aligned_split:
            n = Scheduler._mamba_block_aligned_split(sched, req, n, hit if first else 0, 0)
        n = Scheduler._reserve_prefill_lookahead(sched, req, computed, n)
        assert n > 0, f"scheduled 0 tokens at {computed} of {req.num_tokens}"
        if first:
            out = mgr.allocate_slots(req, n, num_new_computed_tokens=hit, new_computed_blocks=blocks,
                                     num_lookahead_tokens=k)
            req.status = RequestStatus.RUNNING
        else:
            out = mgr.allocate_slots(req, n, num_lookahead_tokens=k)
        assert out is not None
        computed += n
        req.num_computed_tokens = computed
        first = False
        mgr.new_step_starts()
    req.append_output_token_ids(0)
    if k > 0:
        mgr.cache_blocks(req, req.num_computed_tokens)
    mgr.free(req)
    mgr.new_step_starts()
    return hit
