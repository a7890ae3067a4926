"""Build the drafter of the run's kind (speculators' model class the kind names), its optimizer and schedule."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dspark.core.errors import InputError
from dspark.kinds import KINDS, kind_of
from dspark.data.prepare import PreparedData, load_tokenizer
from dspark.train.checkpoint import check_weight_names, damaged, first_line, read_config, weight_names
from dspark.train.config import TrainConfig
from dspark.train.muon import Muon, ns_dtype_for
from dspark.verifier.resolved import Verifier


def attn_impl(device: torch.device) -> str:
    # flex attention has no CPU backward; sdpa works everywhere.
    return "simple_flex_attention" if device.type == "cuda" else "sdpa"


def loss_impl(device: torch.device) -> str:
    return "fused" if device.type == "cuda" else "eager"  # the fused losses are Triton kernels


def vocab_mappings(cfg: TrainConfig, prepared: PreparedData, verifier_vocab: int):
    """t2d/d2t for a reduced draft vocabulary, from prepare's token frequencies."""
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size > verifier_vocab:
        raise InputError(f"--draft-vocab-size {cfg.draft_vocab_size} is larger than the verifier's vocabulary "
                         f"({verifier_vocab} tokens)", f"use a size below {verifier_vocab}, or drop the flag for the "
                         "full vocabulary")
    if cfg.draft_vocab_size is None or cfg.draft_vocab_size == verifier_vocab:
        return None, None, verifier_vocab
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    d2t, t2d = build_vocab_mappings_from_distribution(prepared.token_freq(), cfg.draft_vocab_size, verifier_vocab)
    return t2d, d2t, cfg.draft_vocab_size


def broadcast_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None) -> torch.Tensor:
    """flex_attention.create_mask's dense (1, 1, Q, KV) mask, from one broadcast call of the mask_mod.

    create_mask vmaps the mask_mod over every (q, kv) pair: on CPU that was ~12 ms of a ~20 ms
    drafter forward at the demo's sizes. DSpark's anchor-block mask_mod is elementwise with tensor
    indexing, so calling it on a column of query and a row of key indices gives the same mask.
    """
    assert B in (None, 1) and H in (None, 1), "the drafter's masks have one batch row and one head"
    zero = torch.zeros((), dtype=torch.long, device=device)
    q = torch.arange(Q_LEN, device=device)[:, None]
    kv = torch.arange(KV_LEN, device=device)[None, :]
    return mask_mod(zero, zero, q, kv).expand(Q_LEN, KV_LEN).contiguous()[None, None]


def mask_token_id(cfg: TrainConfig) -> int:
    """--mask-token-id, else the verifier's tokenizer's mask token (what a block drafter's mask slots read)."""
    if cfg.mask_token_id is not None:
        return cfg.mask_token_id
    token = load_tokenizer(cfg.verifier_name_or_path, cfg.trust_remote_code).mask_token_id
    if token is None:
        raise InputError(f"the tokenizer of {cfg.verifier_name_or_path} has no mask token", "pass --mask-token-id")
    return token


def build_model(cfg: TrainConfig, prepared: PreparedData, device: torch.device, verifier: Verifier):
    """speculators' drafter of the run's kind: what every kind takes here, the kind's own arguments from the kind.
    `verifier`: the run's, resolved where the command started."""
    from speculators.models.utils import get_verifier_config
    from speculators.train.cli import create_transformer_layer_config, load_draft_transformer_layer_config

    kind = KINDS[cfg.speculator_type]
    # only its embedding is loaded here, not the whole model
    verifier = str(verifier.check(host_memory=False))
    vcfg = get_verifier_config(verifier, trust_remote_code=cfg.trust_remote_code)
    if cfg.draft_config:
        layer_cfg = load_draft_transformer_layer_config(cfg.draft_config, verifier, cfg.trust_remote_code)
    else:  # speculators' draft decoder layers, of the kind's type (llama for EAGLE-3, qwen3 for the DFlash family)
        layer_cfg = create_transformer_layer_config(
            verifier, cfg.num_layers, kind.decoder_layer, None, sliding_window=cfg.total_seq_len,
            full_attention_indices=list(range(cfg.num_layers)), trust_remote_code=cfg.trust_remote_code)
    t2d, d2t, draft_vocab = vocab_mappings(cfg, prepared, vcfg.vocab_size)
    model = kind.model_class.from_training_args(
        verifier_config=layer_cfg, t2d=t2d, d2t=d2t, verifier_name_or_path=verifier,
        target_layer_ids=cfg.target_layer_ids, draft_vocab_size=draft_vocab, draft_attn_impl=attn_impl(device),
        trust_remote_code=cfg.trust_remote_code, **kind.training_args(cfg, lambda: mask_token_id(cfg)))
    return _dense_masks(model).to(device)


def _dense_masks(model):
    from torch.nn.attention.flex_attention import create_mask

    if getattr(model, "_create_mask_fn", None) is create_mask:  # sdpa (CPU); flex attention builds a block mask
        model._create_mask_fn = broadcast_mask
    return model


def loss_kwargs(model, cfg: TrainConfig, device: torch.device) -> dict:
    train_kw, _ = type(model).get_trainer_kwargs(
        loss_fn=cfg.loss_fn, loss_implementation=loss_impl(device), max_anchors=cfg.max_anchors,
        dflash_decay_gamma=cfg.dflash_decay_gamma, confidence_head_alpha=cfg.confidence_head_alpha,
        per_position_loss_weight=cfg.per_position_loss_weight, dpace_alpha=cfg.dpace_alpha,
        ttt_steps=cfg.ttt_steps, ttt_step_loss_decay=cfg.ttt_step_loss_decay)
    return train_kw


def model_inputs(cfg: TrainConfig, batch: dict) -> dict:
    """A packed batch as the drafter's forward takes it (the kind's `model_inputs`: EAGLE-3 shifts it)."""
    return KINDS[cfg.speculator_type].model_inputs(batch)


def muon_param(name: str, p: torch.Tensor) -> bool:
    # Muon orthogonalizes hidden-layer matrices; embedding tables (the Markov W1 too) and
    # output projections stay on AdamW, as in the Muon paper's recipe.
    return p.ndim == 2 and not any(k in name for k in ("embed", "lm_head", "markov_w1", "markov_w2"))


def build_optimizers(model, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if cfg.optimizer == "muon":
        muon = [p for n, p in params if muon_param(n, p)]
        rest = [p for n, p in params if not muon_param(n, p)]
        device = next(model.parameters()).device
        return [Muon(muon, lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw",
                     ns_dtype=ns_dtype_for(cfg.muon_ns_dtype, device)),
                torch.optim.AdamW(rest, lr=cfg.lr, weight_decay=cfg.weight_decay)]
    return [torch.optim.AdamW([p for _, p in params], lr=cfg.lr, weight_decay=cfg.weight_decay)]


def lr_lambda(kind: str, warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if kind == "none":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0 - progress
    return f


def build_schedulers(opts, cfg: TrainConfig, total_steps: int):
    warmup = int(cfg.scheduler_warmup_ratio * total_steps)
    return [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(cfg.scheduler_type, warmup, total_steps)) for o in opts]


def load_checkpoint(ckpt: Path, verifier: str | None, device: torch.device):
    """The drafter in `ckpt` (a folder `require_checkpoint` accepted), with every tensor it saves loaded."""
    from safetensors import SafetensorError

    ckpt = Path(ckpt)
    kind = kind_of(read_config(ckpt), f"{ckpt}/config.json")
    try:
        config = kind.config_class.from_pretrained(ckpt)
    except (OSError, ValueError, KeyError, TypeError) as e:  # pydantic's ValidationError is a ValueError
        raise damaged(ckpt, f"config.json is not a {kind.name} drafter config ({first_line(e)})") from None
    config.transformer_layer_config._attn_implementation = attn_impl(device)
    verifier = verifier or config.speculators_config.verifier.name_or_path
    if not verifier or not Path(verifier).exists():
        raise InputError(f"the verifier {verifier!r} named by {ckpt} is not a local folder",
                         "pass --verifier-name-or-path the verifier folder")
    # The drafter borrows the verifier's embeddings, final norm and lm_head from this path.
    config.speculators_config.verifier.name_or_path = str(verifier)
    try:
        model = kind.model_class.from_pretrained(ckpt, config=config)
    except (SafetensorError, RuntimeError, ValueError) as e:  # a tensor of another shape, a damaged file
        raise damaged(ckpt, f"model.safetensors does not load ({first_line(e)})") from None
    # from_pretrained leaves a tensor the file lacks at its initial value with at most a log line
    check_weight_names(model, weight_names(ckpt), ckpt)
    return model.to(device).eval()
