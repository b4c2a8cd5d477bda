"""Bodies of the 2-rank layer tests (run in spawned processes, so they live in a module the
children can import): each rank builds the dense model and its TP shard from the same Hugging
Face-named weights and compares the parallel layers' outputs with the dense ones."""

from __future__ import annotations

import torch

from radixserve.distributed.parallel_state import init_tp_group
from radixserve.model_loader.loader import init_dummy_weights
from radixserve.model_loader.model_config import ModelConfig
from radixserve.models.llama import LlamaForCausalLM


def tiny_config(**overrides) -> ModelConfig:
    cfg = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=321,  # odd: the vocabulary split needs padding
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    cfg.update(overrides)
    return ModelConfig.from_hf_config(cfg)


def hf_state(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The dense model's weights under Hugging Face names (fused qkv / gate_up split)."""
    attn = model.model.layers[0].self_attn
    inter = model.model.layers[0].mlp.down_proj.in_features
    out = {}
    for name, p in model.state_dict().items():
        if ".qkv_proj." in name:
            q, k, v = p.split([attn.q_size, attn.kv_size, attn.kv_size])
            for part, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[name.replace("qkv_proj", part)] = t.clone()
        elif ".gate_up_proj." in name:
            for part, t in zip(("gate_proj", "up_proj"), p.split(inter), strict=True):
                out[name.replace("gate_up_proj", part)] = t.clone()
        else:
            out[name] = p.clone()
    return out


def compare_layers(rank: int, world: int, port: int, overrides: dict) -> None:
    torch.manual_seed(0)
    tp = init_tp_group(rank, world, f"127.0.0.1:{port}", "cpu")
    cfg = tiny_config(**overrides)
    dense = LlamaForCausalLM(cfg).eval()
    init_dummy_weights(dense, seed=3)
    with torch.no_grad():  # larger weights than the dummy init, so differences show
        for p in dense.parameters():
            p.mul_(5)
    sharded = LlamaForCausalLM(cfg, tp).eval()
    sharded.load_weights(hf_state(dense).items())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (7,), generator=gen)
    ids[0], ids[1] = cfg.vocab_size - 1, 0  # both ends of the padded split
    x = torch.randn(7, cfg.hidden_size, generator=gen)
    d_layer, s_layer = dense.model.layers[0], sharded.model.layers[0]
    with torch.no_grad():
        close(sharded.model.embed_tokens(ids), dense.model.embed_tokens(ids), "embedding")
        close(s_layer.mlp(x), d_layer.mlp(x), "mlp (column gate_up + row down)")
        close(sharded.compute_logits(x), dense.compute_logits(x), "lm head")
        check_attention_projections(d_layer.self_attn, s_layer.self_attn, x, cfg, tp.rank, world)
    # Leave together and close the groups: a rank that exits with gloo's threads still running
    # (its peer still in a collective, or the group never destroyed) can abort in C++
    # ("terminate called without an active exception") after its checks passed.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def check_attention_projections(dense, sharded, x, cfg, rank, world) -> None:
    hd = cfg.head_dim
    q, k, v = dense.qkv_proj(x).split([dense.q_size, dense.kv_size, dense.kv_size], dim=-1)
    sq, sk, sv = sharded.qkv_proj(x).split(
        [sharded.q_size, sharded.kv_size, sharded.kv_size], dim=-1
    )
    heads = cfg.num_attention_heads // world
    close(sq, q[:, rank * heads * hd : (rank + 1) * heads * hd], "q heads")
    # The KV head each local query head reads (GQA): head h reads KV head h // group.
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    first_kv = rank * heads // group
    n_kv = sharded.num_kv_heads
    close(sk, k[:, first_kv * hd : (first_kv + n_kv) * hd], "k heads")
    close(sv, v[:, first_kv * hd : (first_kv + n_kv) * hd], "v heads")
    y = torch.randn(x.shape[0], dense.q_size)
    cols = slice(rank * heads * hd, (rank + 1) * heads * hd)
    close(sharded.o_proj(y[:, cols].contiguous()), dense.o_proj(y), "o_proj (row parallel)")


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    assert err < 1e-4, f"{what}: max difference {err}"


def join_at(rank: int, world: int, addr: str) -> None:
    """Join the group at --dist-init-addr `addr` and sum the ranks."""
    tp = init_tp_group(rank, world, addr, "cpu")
    assert tp.min_int(rank + 5) == 5
    assert tp.all_reduce(torch.tensor([float(rank)])).item() == sum(range(world))
    torch.distributed.barrier()  # leave together (see compare_layers)
    torch.distributed.destroy_process_group()
