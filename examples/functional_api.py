"""The README's functional-API recipe as a complete program: ``tree_decode`` on a model of your own.

Run (from the repository root, offline, about 10 s on 2 CPU cores):

    torchrun --standalone --nproc_per_node 3 examples/functional_api.py

Every rank holds an uneven slice of one KV cache (GQA: 8 query heads over 2 KV heads; two rows
of different lengths, so the last rank's slice of the short row is empty) and decodes one query
step with every merge strategy; each result must equal attention over the whole cache computed
in one process (``flash_decode`` on the unsharded tensors, and an fp64 reference). The local half
(``flash_decode``) and the exact merge of partial states (``merge_states``) are checked too.
"""

import datetime

import torch
import torch.distributed as dist

import megatron_tree as mt
from megatron_tree.ops import reference  # the pure-torch oracle

# from_env creates the default group from torchrun's variables; timeout bounds every collective below.
groups = mt.TreeGroups.from_env(timeout=datetime.timedelta(minutes=2))
torch.set_num_threads(1)
B, N, HQ, HKV, D = 2, 3000, 8, 2, 64
gen = torch.Generator().manual_seed(0)  # the same tensors on every rank
q = torch.randn(B, 1, HQ, D, generator=gen)
k = torch.randn(B, N, HKV, D, generator=gen)
v = torch.randn(B, N, HKV, D, generator=gen)
lens = torch.tensor([N, N // 2], dtype=torch.int32)

# This rank's slice: rank r holds a share proportional to r + 1 (uneven shards).
P, r = groups.size, groups.rank
cuts = [N * i * (i + 1) // (P * (P + 1)) for i in range(P + 1)]
lo, hi = cuts[r], cuts[r + 1]
k_shard, v_shard = k[:, lo:hi], v[:, lo:hi]
local_lens = (lens - lo).clamp(0, hi - lo).to(torch.int32)  # valid keys of each row in this slice

want, _ = mt.flash_decode(q, k, v, cache_seqlens=lens)  # one process, the whole cache
want64 = reference.partial_attention(q.double(), k.double(), v.double(), cache_seqlens=lens)[0]
worst = 0.0
for strategy in mt.STRATEGIES:
    out = mt.tree_decode(q, k_shard, v_shard, groups, cache_seqlens=local_lens, strategy=strategy)
    err = float((out.double() - want64).abs().max())
    worst = max(worst, err)
    assert err < 1e-5, (strategy, err)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)

# The two halves by hand: local partial states (output + log-sum-exp) of every slice, merged exactly.
outs, lses = zip(*(mt.flash_decode(q, k[:, a:b], v[:, a:b], cache_seqlens=(lens - a).clamp(0, b - a).to(torch.int32))
                   for a, b in zip(cuts, cuts[1:])))
merged, _ = mt.merge_states(torch.stack(outs), torch.stack(lses))
merge_err = float((merged.double() - want64).abs().max())
assert merge_err < 1e-5, merge_err

if dist.get_rank() == 0:
    print(f"tree_decode at CP {P} (slices {[b - a for a, b in zip(cuts, cuts[1:])]} of {N} tokens), "
          f"strategies {', '.join(mt.STRATEGIES)}: max|out - fp64 reference| {worst:.2e}; "
          f"merge_states of {P} partial states: {merge_err:.2e}; all equal the single-process result")
dist.destroy_process_group()
