"""Every private interface of transformers, accelerate and torch that patchkv touches (`patchkv/compat.py`), checked
by name against the installed versions: a release that renames or drops one fails here, naming it."""

import inspect

import pytest
import torch
from conftest import calibration_ids, make_model
from transformers import DynamicCache, QuantizedCache
from transformers.generation.utils import GenerationMixin

import patchkv
from patchkv import compat


def test_generate_builds_its_cache_in_prepare_cache_for_generation():
    method = getattr(GenerationMixin, compat.PREPARE_CACHE)
    params = list(inspect.signature(method).parameters)
    assert params[:3] == ["self", "generation_config", "model_kwargs"], params


def test_generate_marks_a_cache_the_user_passed():
    model = make_model("llama")
    seen = {}

    def spy(generation_config, model_kwargs, *args, **kwargs):
        out = compat.prepare_cache(model, generation_config, model_kwargs, *args, **kwargs)
        seen["flag"] = compat.is_user_defined(model_kwargs.get("cache"))
        return out

    compat.set_cache_preparer(model, spy)
    model.generate(calibration_ids(1, 5), max_new_tokens=2, do_sample=False, cache=DynamicCache())
    assert seen["flag"] is True
    compat.set_cache_preparer(model, None)
    assert compat.installed_cache_preparer(model) is None


def test_the_models_attention_function_and_implementation():
    model = make_model("llama", attn="eager")
    attn = model.model.layers[0].self_attn
    assert compat.attn_implementation(model.config) == "eager"
    assert compat.attention_function(attn).__name__ == "eager_attention_forward"
    model.set_attn_implementation("sdpa")
    assert compat.attn_implementation(model.config) == "sdpa"
    assert compat.attention_function(attn).__name__ == "sdpa_attention_forward"


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3"])
def test_one_rotary_module_with_a_rope_type(family):
    found = compat.rotary_modules(make_model(family))
    assert len(found) == 1 and hasattr(found[0], "rope_type")


def test_removing_a_kwargs_pre_hook_by_id():
    module = torch.nn.Linear(2, 2)
    handle = module.register_forward_pre_hook(lambda m, args, kwargs: None, with_kwargs=True)
    assert handle.id in module._forward_pre_hooks and handle.id in module._forward_pre_hooks_with_kwargs
    compat.remove_pre_hook(module, handle.id)
    assert not module._forward_pre_hooks and not module._forward_pre_hooks_with_kwargs


def test_accelerate_hooks_and_execution_device():
    accelerate = pytest.importorskip("accelerate")
    module = torch.nn.Linear(2, 2)
    assert compat.accelerate_hook(module) is None and compat.execution_device(module) is None
    accelerate.hooks.add_hook_to_module(module, accelerate.hooks.AlignDevicesHook(execution_device="cpu"))
    assert hasattr(compat.accelerate_hook(module), "pre_forward")
    assert compat.execution_device(module) == torch.device("cpu")


@pytest.mark.parametrize("backend", ["quanto", "hqq"])
def test_a_quantized_cache_layer_keeps_its_codes_where_compat_reads_them(backend):
    pytest.importorskip("optimum.quanto" if backend == "quanto" else "hqq")
    model = make_model("llama")
    cache = QuantizedCache(backend=backend, config=model.config, nbits=4, q_group_size=16, residual_length=4)
    with torch.no_grad():
        model(calibration_ids(1, 12), cache=cache, use_cache=True)
    keys, values = compat.quantized_storage(cache.layers[0])
    assert keys is not None and values is not None
    assert compat.quantized_storage(DynamicCache(config=model.config).layers[0]) == (None, None)


def test_a_cache_layers_init_sets_what_compat_sets_but_keys_and_values():
    """`LatentLayer` does not run `CacheLayerMixin.__init__` (its `keys` and `values` are read-only views):
    `compat.init_cache_layer` sets the rest of what it sets."""
    from types import SimpleNamespace

    from transformers.cache_utils import CacheLayerMixin

    mixin, ours = SimpleNamespace(), SimpleNamespace()
    CacheLayerMixin.__init__(mixin)
    compat.init_cache_layer(ours)
    assert tuple(vars(mixin)) == ("keys", "values", "is_initialized")
    assert vars(ours) == {name: value for name, value in vars(mixin).items() if name not in ("keys", "values")}


def test_nothing_else_reads_these_private_names():
    """The touchpoints are read in compat.py only (docstrings and error messages may name them)."""
    import pathlib

    root = pathlib.Path(patchkv.__file__).parents[1]
    private = ("._hf_hook", "_forward_pre_hooks", "._attn_implementation", "._is_user_defined", "sys.modules[",
               '"_hf_hook"', '"_attn_implementation"', '"_is_user_defined"', "_name_or_path", '"_quantized_')
    offenders = []
    for folder in ("patchkv", "adapters", "kernels"):
        for path in (root / folder).rglob("*.py"):
            if path.name == "compat.py" or path == root / "kernels" / "__init__.py":  # its top-level-name hand-over
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if any(p in line for p in private):
                    offenders.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not offenders, offenders
