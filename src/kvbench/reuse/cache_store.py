"""Reusable per-image KV caches on disk (CONDUIT §3.1, App. A.3; authors' ``model_runner_priori.py``).

Each image is prefilled *alone* under the model's single-image chat template
with the generic prefix (messages: ``system = generic_system``,
``user = [that image]``, rendered by the processor's own template). For its
visual tokens we keep, per decoder layer:

- ``k.<l>``: keys **pre-RoPE**, ``[n_kv_heads, n_tokens, head_dim]``. Captured by
  a forward hook on ``self_attn.k_proj`` (plus ``k_norm`` where the architecture
  has one), i.e. exactly the tensor the attention rotates; no numerical
  inversion is involved (tests cross-check against inverting the HF cache's
  post-RoPE keys).
- ``v.<l>``: values, same shape (values carry no position).
- ``embeds``: the vision-tower output ``[n_tokens, hidden]``, the layer-0 input
  of these tokens. It does not depend on the prefix, so a refresh recomputes
  selected tokens from it without re-running the vision tower (the authors'
  encoder cache).

Files: ``<root>/manifest.json`` pins the directory to one model and template;
``<root>/<key>.safetensors`` + ``<root>/<key>.json`` (sidecar: sha256 of the
tensor file, model id, template id, grid, shapes). The key is the sha256 of
(model fingerprint, template hash, sha256 of the processed pixel values,
``image_grid_thw``), so two different images never share an entry and one
image under two models or templates gets two entries. Both files are written
atomically (tensor file first, sidecar last as the commit marker). A tensor
file whose hash differs from its sidecar is treated as corrupt and rebuilt,
never used.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kvbench.models.prompting import load_image
from kvbench.reuse.adapter import VLMAdapter
from kvbench.utils.io import atomic_path, sha256_file, write_json

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


def single_image_messages(generic_system: str) -> list[dict]:
    """Messages of the cache-time prompt: the generic system prefix and one user turn holding only the image."""
    return [{"role": "system", "content": generic_system},
            {"role": "user", "content": [{"type": "image"}]}]


def template_hash(processor: Any, generic_system: str) -> str:
    """sha256 of the rendered single-image prompt (template + generic prefix, image placeholder unexpanded)."""
    text = processor.apply_chat_template(single_image_messages(generic_system), tokenize=False,
                                         add_generation_prompt=True)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class ImageKV:
    """Cached state of one image (read-only by contract; the engine never writes into these tensors).

    Attributes:
        key: content key (hex sha256).
        grid_thw: the image's ``image_grid_thw`` (patch grid before merging) or ``None``.
        keys: per layer, pre-RoPE keys ``[n_kv_heads, n_tokens, head_dim]`` (model dtype).
        values: per layer, values, same shape.
        embeds: vision-tower output ``[n_tokens, hidden]``.
    """

    key: str
    grid_thw: tuple[int, ...] | None
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    embeds: torch.Tensor

    @property
    def n_tokens(self) -> int:
        return self.embeds.shape[0]


class CacheMismatchError(ValueError):
    """The cache directory or entry was built for another model or template."""


class ImageKVStore:
    """Directory of reusable per-image caches for one (model, template, generic prefix).

    Args:
        root: directory (created if missing).
        adapter: the model's :class:`~kvbench.reuse.adapter.VLMAdapter`.
        generic_system: the prefix images are cached under (record field ``generic_system``).

    Raises:
        CacheMismatchError: ``root`` already holds a cache for another model or template
            (message names both fingerprints).
    """

    def __init__(self, root: str | Path, adapter: VLMAdapter, generic_system: str):
        self.root = Path(root)
        self.adapter = adapter
        self.generic_system = generic_system
        self.model_id = adapter.fingerprint()
        self.template_id = template_hash(adapter.processor, generic_system)
        self.stats = {"built": 0, "reused": 0, "rebuilt_corrupt": 0}
        self._check_manifest()

    # --- directory identity -------------------------------------------------------------------
    def _check_manifest(self) -> None:
        manifest = self.root / "manifest.json"
        want = self.identity()
        if manifest.exists():
            try:
                have = json.loads(manifest.read_text())
            except json.JSONDecodeError as e:
                raise CacheMismatchError(f"image cache manifest {manifest} is not valid JSON ({e}); "
                                         f"delete {self.root} and rebuild it with `kvbench cache`") from None
            for field in want:
                if have.get(field) != want[field]:
                    raise CacheMismatchError(
                        f"image cache {self.root} was built for {field}={have.get(field)!r}, this run has "
                        f"{want[field]!r} (model class {type(self.adapter.model).__name__}; cache-time prefix "
                        f"there {have.get('generic_system')!r}, here {self.generic_system!r}); a store holds one "
                        "model and one cache-time prefix: give this one its own directory")
        else:
            write_json(manifest, {**want, "model_class": type(self.adapter.model).__name__,
                                  "generic_system": self.generic_system})

    def identity(self) -> dict:
        """What pins the directory and each entry: format, model and template (a subclass adds its own fields, e.g.
        the compressed store's codec); the manifest holds these fields and every sidecar must match them."""
        return {"format": FORMAT_VERSION, "model_id": self.model_id, "template_id": self.template_id}

    # --- keys ---------------------------------------------------------------------------------
    def encode_image(self, image: Any, base_dir: str | Path | None = None) -> dict:
        """Processor inputs of the single-image cache prompt for ``image`` (PIL image or path)."""
        img = load_image(image, base_dir)
        return self.adapter.encode(single_image_messages(self.generic_system), [img])

    def key_for(self, enc: dict) -> str:
        """Content key of an encoded single-image prompt."""
        pix = enc["pixel_values"].detach().contiguous().cpu()
        grid = enc.get("image_grid_thw")
        ident = {
            "model": self.model_id, "template": self.template_id,
            "pixels": hashlib.sha256(pix.view(torch.uint8).numpy().tobytes()).hexdigest(),
            "pixel_shape": list(pix.shape), "pixel_dtype": str(pix.dtype),
            "grid_thw": grid[0].tolist() if grid is not None else None,
        }
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()

    def paths(self, key: str) -> tuple[Path, Path]:
        return self.root / f"{key}.safetensors", self.root / f"{key}.json"

    # --- build / load -------------------------------------------------------------------------
    def get(self, image: Any, base_dir: str | Path | None = None) -> ImageKV:
        """The cached state of ``image``: loaded when a verified entry exists, else built and stored.

        A tensor file whose sha256 differs from its sidecar (or a missing /
        unreadable sidecar) is rebuilt, never used.

        Raises:
            CacheMismatchError: the entry's sidecar names another model or template.
            FileNotFoundError: ``image`` is a path that does not exist.
        """
        enc = self.encode_image(image, base_dir)
        key = self.key_for(enc)
        entry = self._load(key)
        if entry is not None:
            self.stats["reused"] += 1
            return entry
        return self._build(enc, key)

    def entries(self, record: dict, base_dir: str | Path | None = None) -> list[ImageKV]:
        """Cached states of a record's images, in prompt order.

        Raises:
            ValueError: the record has no image part.
        """
        images = [p["image"] for p in record.get("content", []) if p.get("type") == "image"]
        if not images:
            raise ValueError(f"record {record.get('id')!r} has no image part; the reuse engine needs >= 1 image")
        return [self.get(im, base_dir) for im in images]

    def _read(self, key: str) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """``(sidecar, tensors)`` of a verified entry, or None when it is missing or corrupt (counted).

        Raises:
            CacheMismatchError: the sidecar's model, template or other :meth:`identity` field is not this store's.
        """
        tensors, sidecar = self.paths(key)
        if not tensors.exists() or not sidecar.exists():
            return None
        try:
            meta = json.loads(sidecar.read_text())
        except (OSError, json.JSONDecodeError):
            log.warning("image cache %s: unreadable sidecar, rebuilding", sidecar)
            self.stats["rebuilt_corrupt"] += 1
            return None
        want = {k: v for k, v in self.identity().items() if k != "format"}
        bad = [k for k, v in want.items() if meta.get(k) != v]
        if bad:
            raise CacheMismatchError(
                f"image cache entry {sidecar} was built for model {meta.get('model_id')!r} / template "
                f"{meta.get('template_id')!r}, this run has {self.model_id!r} / {self.template_id!r}; fields that "
                f"differ: {', '.join(f'{k} {meta.get(k)!r} (here {want[k]!r})' for k in bad)}")
        if sha256_file(tensors) != meta.get("sha256"):
            log.warning("image cache %s: sha256 differs from its sidecar (corrupt), rebuilding", tensors)
            self.stats["rebuilt_corrupt"] += 1
            return None
        return meta, load_file(tensors, device=str(self.adapter.device))

    def _load(self, key: str) -> ImageKV | None:
        entry = self._read(key)
        if entry is None:
            return None
        meta, t = entry
        n_layers = meta["n_layers"]
        return ImageKV(key=key, grid_thw=tuple(meta["grid_thw"]) if meta.get("grid_thw") else None,
                       keys=tuple(t[f"k.{i}"] for i in range(n_layers)),
                       values=tuple(t[f"v.{i}"] for i in range(n_layers)), embeds=t["embeds"])

    @torch.no_grad()
    def _build(self, enc: dict, key: str) -> ImageKV:
        ad = self.adapter
        mask = ad.image_token_mask(enc)
        n = int(mask.sum())
        if n == 0:
            raise ValueError("single-image prompt produced no visual tokens (processor/template mismatch)")
        captured: dict[str, torch.Tensor] = {}
        hooks = []

        def grab(name):
            def hook(_m, _args, out):
                captured[name] = out.detach()
            return hook

        def grab_embeds(_m, _args, kwargs):
            captured["embeds"] = kwargs["inputs_embeds"].detach()

        for i, layer in enumerate(ad.layers):
            hooks.append(layer.self_attn.k_proj.register_forward_hook(grab(f"k.{i}")))
            hooks.append(layer.self_attn.v_proj.register_forward_hook(grab(f"v.{i}")))
        hooks.append(ad.decoder.register_forward_pre_hook(grab_embeds, with_kwargs=True))
        try:
            ad.full_forward(enc)
        finally:
            for h in hooks:
                h.remove()
        T = enc["input_ids"].shape[1]
        out: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(ad.layers):
            k = captured[f"k.{i}"].view(T, ad.n_kv_heads, ad.head_dim)
            if hasattr(layer.self_attn, "k_norm"):  # Qwen3-style: the norm acts before RoPE
                k = layer.self_attn.k_norm(k)
            v = captured[f"v.{i}"].view(T, ad.n_kv_heads, ad.head_dim)
            out[f"k.{i}"] = k[mask].transpose(0, 1).contiguous()
            out[f"v.{i}"] = v[mask].transpose(0, 1).contiguous()
        out["embeds"] = captured["embeds"][0, mask].contiguous()
        grid = enc.get("image_grid_thw")
        tensors, sidecar = self.paths(key)
        with atomic_path(tensors) as tmp:
            save_file({k: v.cpu() for k, v in out.items()}, str(tmp))
        meta = {"format": FORMAT_VERSION, "key": key, "model_id": self.model_id, "template_id": self.template_id,
                "sha256": sha256_file(tensors), "n_layers": ad.n_layers, "n_tokens": n,
                "grid_thw": grid[0].tolist() if grid is not None else None, "dtype": str(ad.dtype),
                "k_capture": "k_proj forward hook (pre-RoPE)"}
        write_json(sidecar, meta)
        self.stats["built"] += 1
        return ImageKV(key=key, grid_thw=tuple(meta["grid_thw"]) if meta["grid_thw"] else None,
                       keys=tuple(out[f"k.{i}"] for i in range(ad.n_layers)),
                       values=tuple(out[f"v.{i}"] for i in range(ad.n_layers)), embeds=out["embeds"])
