"""Built-in example models for ``python -m hybrid plan --model``, as TensorSpec lists (no framework needed)."""

from __future__ import annotations

from hybrid.core import TensorSpec


def _linear(name: str, fan_in: int, fan_out: int, dtype: str = "float32") -> list[TensorSpec]:
    # torch's nn.Linear layout: weight (out, in), then bias.
    return [TensorSpec(f"{name}.weight", (fan_out, fan_in), dtype), TensorSpec(f"{name}.bias", (fan_out,), dtype)]


def mlp(width: int = 2048, depth: int = 6) -> list[TensorSpec]:
    """A plain MLP: ``depth`` Linear layers of ``width`` (about 25M parameters by default)."""
    return [s for i in range(depth) for s in _linear(f"layers.{i}", width, width)]


def gpt2_small() -> list[TensorSpec]:
    """GPT-2 small (124M parameters) in Hugging Face's naming and registration order."""
    d, ff = 768, 3072
    specs = [TensorSpec("wte.weight", (50257, d), "float32"), TensorSpec("wpe.weight", (1024, d), "float32")]
    for i in range(12):
        h = f"h.{i}"
        specs += [TensorSpec(f"{h}.ln_1.weight", (d,), "float32"), TensorSpec(f"{h}.ln_1.bias", (d,), "float32")]
        specs += _linear(f"{h}.attn.c_attn", d, 3 * d) + _linear(f"{h}.attn.c_proj", d, d)
        specs += [TensorSpec(f"{h}.ln_2.weight", (d,), "float32"), TensorSpec(f"{h}.ln_2.bias", (d,), "float32")]
        specs += _linear(f"{h}.mlp.c_fc", d, ff) + _linear(f"{h}.mlp.c_proj", ff, d)
    return specs + [TensorSpec("ln_f.weight", (d,), "float32"), TensorSpec("ln_f.bias", (d,), "float32")]


def convnet() -> list[TensorSpec]:
    """A small ResNet-like convnet with BatchNorm: many small tensors."""
    specs, channels = [], [3, 32, 64, 128, 256]
    for i, (c_in, c_out) in enumerate(zip(channels, channels[1:])):
        for j in range(2):
            c = c_in if j == 0 else c_out
            specs.append(TensorSpec(f"stage{i}.conv{j}.weight", (c_out, c, 3, 3), "float32"))
            specs += [TensorSpec(f"stage{i}.bn{j}.weight", (c_out,), "float32"),
                      TensorSpec(f"stage{i}.bn{j}.bias", (c_out,), "float32")]
    return specs + _linear("fc", channels[-1], 1000)


def mixed_precision() -> list[TensorSpec]:
    """An MLP whose hidden layers are bfloat16 and whose head stays float32: two bucket keys."""
    body = [s for i in range(4) for s in _linear(f"body.{i}", 1024, 1024, "bfloat16")]
    return body + _linear("head", 1024, 10, "float32")


EXAMPLES = {"mlp": mlp, "gpt2-small": gpt2_small, "convnet": convnet, "mixed": mixed_precision}
