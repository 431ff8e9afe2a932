"""A model that `transformers` builds and saves, for lesson 23's tests: LlamaForCausalLM from a LlamaConfig of
the course GPT's layout (tests/test_day5_hf.py's sizes), its weights drawn by transformers' own initialization
under a seed, written with save_pretrained (config.json, model.safetensors) into DIR; nothing is downloaded.

    python tests/hf_model.py DIR
"""
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SIZES = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=256)

if __name__ == "__main__":
    torch.manual_seed(11)
    model = LlamaForCausalLM(LlamaConfig(**SIZES))
    with torch.no_grad():  # norms away from 1, so that a norm loaded as 1 (or not at all) shows in the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(sys.argv[1])
