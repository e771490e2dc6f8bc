"""A torchtitan config registry with one tiny llama3 (``--module tiny_llama3 --config llama3_tiny``).

torchtitan 0.3.0 takes the model only from a registry function (``model_spec`` is not a
command-line field), so a model small enough for a 2-core CPU test needs a registry of its own,
as any torchtitan user adding a model writes one. Everything else (steps, sequence length, batch,
checkpointing, seed, paths) stays on the command line, as torchtitan users give it. It is built
from torchtitan's own llama3 pieces, so the model is torchtitan's llama3 at smaller dimensions.
"""

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.llama3 import (
    _EMBEDDING_INIT,
    _NORM_INIT,
    Llama3Model,
    _build_llama3_layers,
    _output_linear_init,
    model_registry,
)
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

DIM, HEADS, LAYERS, VOCAB = 64, 4, 2, 512


def tiny_model(attn_backend: str = "flex") -> Llama3Model.Config:
    """torchtitan's debugmodel (dim 256, 6 layers, vocab 2048) shrunk to what a 2-core machine
    trains in well under a second per step."""
    return Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_llama3_layers(
            fuse_qkv=True,
            n_layers=LAYERS,
            dim=DIM,
            n_heads=HEADS,
            hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=64),
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=4096, theta=500000, scaling="llama"),
            attn_backend=attn_backend,
        ),
    )


def llama3_tiny() -> Trainer.Config:
    """``llama3_debugmodel`` with the tiny model; no validation (no validation data offline)."""
    config = llama3_debugmodel()
    spec = model_registry("debugmodel")
    spec.model = tiny_model()
    spec.flavor = "tiny"
    config.model_spec = spec
    config.loss = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=VOCAB))
    config.validator.enable = False
    return config
