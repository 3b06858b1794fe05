"""The dynamic engine's model, workloads and error reports, shared by the 0.16.1 and 0.19 dynamic-engine tests."""

from __future__ import annotations

import torch
from tests.helpers.weights import seed_weights


VOCAB, HIDDEN, HEADS, KV_HEADS = 96, 64, 4, 2

MAX_LEN = 320


PROMPT_LENS = (5, 64, 300, 1)


NEW_TOKENS = [12, 7, 9, 5]


ARRIVALS = [0, 0, 3, 4]


BYTES_PER_TOKEN = 2 * 2 * KV_HEADS * (HIDDEN // HEADS) * 4  # k+v, layers, heads, dim, fp32


def gb(blocks: int, block_tokens: int) -> float:
    """A buffer size that Megatron turns into exactly ``blocks`` blocks of ``block_tokens`` tokens."""
    return (blocks + 0.5) * block_tokens * BYTES_PER_TOKEN / 2**30


def build_dynamic_model(cp, hier, tree: bool, strategy="auto"):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_tree.integrations.megatron import get_gpt_layer_tree_spec

    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)
    config = TransformerConfig(
        attention_backend=AttnBackend.local, num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=KV_HEADS, ffn_hidden_size=4 * HIDDEN, use_cpu_initialization=True,
        context_parallel_size=cp, hierarchical_context_parallel_sizes=hier, params_dtype=torch.float32,
        attention_dropout=0.0, hidden_dropout=0.0, add_bias_linear=False,
    )
    spec = get_gpt_layer_tree_spec(strategy=strategy) if tree else get_gpt_layer_local_spec()
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=MAX_LEN, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    return seed_weights(model).eval()  # the same weights everywhere, clear greedy margins


def IdTokenizer():
    """Token ids as text: all the engine needs from a tokenizer."""
    from megatron_tree.integrations.megatron.model import IdTokenizer

    return IdTokenizer(eod=VOCAB - 1)


def stall_prompts(lengths=PROMPT_LENS, seed=11):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist() for n in lengths]


def run_dynamic(engine, prompts=None, counts=None, arrivals=None, hook=None):
    from megatron_tree.integrations.megatron.dynamic import generate_dynamic

    r = generate_dynamic(engine, prompts or stall_prompts(), num_tokens_to_generate=counts or NEW_TOKENS,
                         arrivals=arrivals or ARRIVALS, hook=hook)
    return {"tokens": r.tokens, "log_probs": r.log_probs, "finished": r.finished_step, "steps": r.steps,
            "status": r.status, "errors": r.errors, "blocks": r.blocks_per_rank, "spread": r.max_blocks_per_rank,
            "evicted": r.evicted, "live": r.live_requests, "rewound": r.rewound_tokens}


def error_text(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 -- the test asserts on type and message
        return f"{type(err).__name__}: {err}"
    return "no error"


STALL = dict(prompts=[[(7 * i + 3 * j) % 90 for j in range(n)] for i, n in enumerate([21, 16, 5, 119, 16, 5, 6])],
             counts=[9, 8, 5, 9, 5, 5, 9], arrivals=[0, 0, 1, 3, 3, 3, 3])


STALL_ENGINE = dict(blocks=23, block=8, max_len=136, max_tokens=64)


class GuardDecodeForwards:
    """Runs every decode-only model forward of a dynamic engine under ``sync_guard.no_host_sync``.

    Decode-only: every active request has one query token (Megatron's ``is_decode_only()``). The
    guard spans the wrapper's ``_forward``, which is the model's forward (``GPTModel.forward``:
    embedding, layers with our KV-cache hook, RoPE at global positions, the paged ``tree_decode``
    and its merge collectives, the output layer); the step's plan (``initialize_attention_state``)
    runs before it, outside. Counts the guarded forwards (``guarded``) and keeps each
    ``HostSyncError`` message (``syncs``); a forward that raised runs again unguarded, so the run
    goes on and the test reports the sync (every CP rank runs the same code, so all raise alike).
    ``forwards`` lists every forward as [real tokens of the step, active requests, ran inside the
    guard], so a test can check, by counts taken apart from Megatron's flag, which forwards the guard
    spanned.
    """

    WHERE = "a decode forward of Megatron's dynamic engine"

    def __init__(self, engine):
        wrapper = engine.controller.inference_wrapped_model
        self.context = wrapper.inference_context
        self.forward = wrapper._forward
        wrapper._forward = self
        self.guarded = 0
        self.syncs: list[str] = []
        self.forwards: list[list] = []
        self.active = False

    def __call__(self, inference_input):
        from megatron_tree.utils.sync_guard import HostSyncError, no_host_sync

        record = [self.context.step.num_tokens, self.context.get_active_request_count(), False]
        self.forwards.append(record)
        if not self.context.is_decode_only():
            return self.forward(inference_input)
        self.guarded += 1
        try:
            with no_host_sync(self.WHERE):
                record[2] = True  # inside the guard
                self.active = True
                try:
                    return self.forward(inference_input)
                finally:
                    self.active = False
        except HostSyncError as err:
            self.syncs.append(str(err))
            return self.forward(inference_input)

    def inject_host_read(self) -> None:
        """The negative check: the next guarded forward reads a device value on the host inside our
        KV-cache hook (``int()`` of the step's largest visible key count), once, before the hook stores."""
        ctx = self.context

        def store_and_read(*args):
            if self.active:
                del ctx.store_key_value  # once: the rerun stores with the context's own hook
                int(ctx.step.cache_seqlens.max())
            return type(ctx).store_key_value(ctx, *args)

        ctx.store_key_value = store_and_read
