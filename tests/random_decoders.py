"""Tiny random decoders saved as transformers checkpoints, shared by the test folders (tests/ is on the import
path: its conftest.py puts it there)."""
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig


def save_random_decoder(config: PretrainedConfig, path, random_biases_and_norms: bool = True, **save_kwargs):
    """A seeded random transformers model of `config` saved under `path`; returns it in eval mode. With
    random_biases_and_norms, biases and norm weights are drawn too, so a wrong weight mapping (or a bias
    applied twice) cannot hide behind zeros and ones."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if random_biases_and_norms:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    param.copy_(torch.randn_like(param) * 0.5 + (0.0 if name.endswith("bias") else 1.0))
    model.save_pretrained(path, **save_kwargs)
    return model.eval()
