"""Feature extraction: run a target over a prompt set and record what a drafter learns from.

    python data/extract.py --config configs/extract_toy.yaml                 # or: python -m data.extract ...
    python -m data.extract --config extract_toy                              # a bare name resolves in configs/
    python data/extract.py --config configs/extract_toy.yaml out_dir=shards/toy batch_size=32
    python data/extract.py --config configs/extract_toy.yaml --prompts.count 16 --print_config   # LightningCLI style
    torchrun --nproc_per_node 4 data/extract.py --config configs/extract_toy.yaml
    python -m data.extract --merge shards/toy        # write manifest.json if the last rank could not
    python -m data.extract --validate shards/toy     # re-read every shard: sha256, shapes, dtypes, NaN/Inf, counts

Per sample: the target samples an image with its own sampling settings and CFG (`generate_ar`),
then one teacher-forced pass over the [cond; uncond] rows (prefill + forward over tokens 0..G-2)
records, for every image token j, the last-layer post-norm hidden state that predicts it (and on
request the EAGLE-3 auxiliary streams, the unconditional row's state and, with both, the unconditional
row's auxiliary streams). See data/shards.py for the shard layout.

Determinism and resumption. Global sample s uses prompt s // samples_per_prompt. Shard i holds
samples [i S, (i + 1) S) and is cut into batches of `batch_size` consecutive samples; the batch
starting at sample b is sampled with a torch.Generator seeded by `derive_seed(seed, b)`. A batched
multinomial draws from one generator, so per-sample generators are not possible; fixing the batch
composition by global index instead makes every sample a function of (config, s) alone, whatever
the number of ranks and wherever a run was interrupted. A shard is written to `<name>.partial`
and renamed when complete; a rerun skips finished shards and never rewrites them.

Ranks (torchrun's RANK / WORLD_SIZE; no process group needed): rank r writes shards i = r mod W.
Shard names depend only on i, so a job may be resumed with a different number of ranks. Each
finished shard leaves a sidecar (`.extract/shard-NNNNNN.json`: count, sha256); whichever rank
finds every shard done writes `manifest.json` (identical content, atomic), and `--merge` does the
same by hand.

Shapes: B prompts in a batch, R rows (2B with CFG), G image tokens, D hidden size.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from torch import Tensor
from tqdm import tqdm

from data.extract_config import ExtractConfig, load_config, resolve_config_path, split_dotted_flags
from data.fp8 import FLOAT16_MAX, FP8_DTYPE, quantize_rows, scale_member
from data.manifest import field_widths
from data.prompts import Prompt, load_prompts
from data.shard_reader import iter_raw_samples
from data.shards import (
    FieldSpec,
    Manifest,
    ShardInfo,
    ShardWriter,
    TargetIdentity,
    sample_key,
    shard_name,
    write_atomic,
)
from data.validate import validate_dataset
from inference.decoding.autoregressive import generate_ar
from models.checkpoint_identity import CheckpointIdentity, checkpoint_identity
from models.registry import load_target, process_target_options
from models.target import ImageTarget, SamplingDefaults, teacher_forced_states

WORK_DIR = ".extract"
"""Sub-folder of the output holding the job description and one sidecar per finished shard."""


def derive_seed(base_seed: int, index: int) -> int:
    """A 63-bit seed fixed by (base seed, sample index), well mixed so neighbouring batches are unrelated."""
    return int(np.random.SeedSequence([base_seed, index]).generate_state(1, np.uint64)[0] >> np.uint64(1))


@torch.no_grad()
def extract_batch(
    target: ImageTarget,
    prompts: list[str],
    settings: SamplingDefaults,
    generator: torch.Generator,
    store_aux: bool = True,
    store_uncond: bool = False,
    features: str = "full",
) -> dict[str, Tensor]:
    """Sample one image per prompt, then (features "full") record the states that predicted each of its tokens.

    Returns:
        tokens (B, G) int64; with features "full" also hidden (B, G, D) and optionally aux (B, G, 3D)
        (store_aux), uncond_hidden (B, G, D) (store_uncond) and uncond_aux (B, G, 3D) (both), in the
        target's dtype, from `teacher_forced_states`. Row j predicts token j: image_head(hidden[:, j])
        gives its conditional logits, image_head(uncond_hidden[:, j]) its unconditional ones.
    """
    cfg = settings.cfg_scale != 1.0
    if store_uncond and not cfg and features == "full":
        raise ValueError("store_uncond needs CFG, but cfg_scale is 1.0; set cfg_scale or store_uncond: false")
    tokens = generate_ar(target, prompts, settings, generator).tokens  # (B, G)
    if features == "tokens":
        return {"tokens": tokens}
    states = teacher_forced_states(target, prompts, tokens, aux=store_aux, uncond=store_uncond)
    return {"tokens": tokens, **states.fields()}


@dataclass
class _Job:
    """What every rank derives identically from the config: prompts, shard plan, manifest header."""

    config: ExtractConfig
    prompts: list[Prompt]
    settings: SamplingDefaults
    header: Manifest

    @property
    def num_shards(self) -> int:
        return math.ceil(self.header.num_samples / self.config.samples_per_shard)

    def shard_range(self, index: int) -> range:
        size = self.config.samples_per_shard
        return range(index * size, min((index + 1) * size, self.header.num_samples))


def build_job(config: ExtractConfig, target: ImageTarget, checkpoint: CheckpointIdentity | None = None) -> _Job:
    """Load the prompts and describe the dataset this config produces (the manifest without shards).

    `checkpoint`: the weights `target` was loaded from, recorded in the manifest (None: unknown).
    """
    prompts = load_prompts(config.prompts)
    settings = config.sampling_settings(target)
    widths = field_widths(TargetIdentity.from_target(target))
    full = config.features == "full"
    stored = {
        "hidden": full,
        "aux": full and config.store_aux,
        "uncond_hidden": full and config.store_uncond,
        "uncond_aux": full and config.store_aux and config.store_uncond,
    }
    fields = {"tokens": FieldSpec("int16" if target.image_vocab_size <= 2**15 else "int32", None)}
    fields.update({name: FieldSpec(config.feature_dtype, widths[name]) for name, on in stored.items() if on})
    texts = hashlib.sha256("\n".join(f"{p.id}\t{p.text}" for p in prompts).encode()).hexdigest()
    header = Manifest(
        target=TargetIdentity.from_target(target),
        sampling={
            **dataclasses.asdict(settings),
            "seed": config.seed,
            "batch_size": config.batch_size,
            "samples_per_prompt": config.samples_per_prompt,
            "seed_rule": "batches of batch_size consecutive samples within a shard; generator seeded "
            "with derive_seed(seed, first sample index of the batch)",
        },
        prompts={**config.prompts.describe(), "num_prompts": len(prompts), "sha256": texts},
        features=config.features,
        fields=fields,
        num_tokens=target.geometry.num_tokens,
        samples_per_shard=config.samples_per_shard,
        num_samples=len(prompts) * config.samples_per_prompt,
        checkpoint=checkpoint,
    )
    return _Job(config, prompts, settings, header)


def _write_shard(job: _Job, target: ImageTarget, index: int, bar: tqdm, bytes_before: int) -> ShardInfo:
    """Generate and write shard `index`; `bytes_before` (bytes already written) only feeds the progress bar."""
    out_dir = Path(job.config.out_dir)
    indices = job.shard_range(index)
    writer = ShardWriter(out_dir / shard_name(index))
    try:
        for start in range(indices.start, indices.stop, job.config.batch_size):
            batch = range(start, min(start + job.config.batch_size, indices.stop))
            prompts = [job.prompts[s // job.config.samples_per_prompt] for s in batch]
            seed = derive_seed(job.config.seed, start)
            generator = torch.Generator(device=target.device).manual_seed(seed)
            out = extract_batch(
                target,
                [p.text for p in prompts],
                job.settings,
                generator,
                job.config.store_aux,
                job.config.store_uncond,
                job.config.features,
            )
            arrays: dict[str, np.ndarray] = {}  # (B, G, width) features, and (B, G) row scales for float8
            for name, tensor in out.items():
                if name != "tokens":
                    arrays.update(_cast_checked(tensor.float().cpu().numpy(), job.config.feature_dtype, name, start))
            tokens = out["tokens"].cpu().numpy().astype(job.header.fields["tokens"].dtype)
            for row, (sample, prompt) in enumerate(zip(batch, prompts, strict=True)):
                meta = {
                    "index": sample,
                    "prompt_id": prompt.id,
                    "prompt": prompt.text,
                    "seed": seed,
                    "batch_row": row,
                    "length": int(tokens.shape[1]),
                }
                writer.write(
                    sample_key(sample), {"tokens": tokens[row], **{k: v[row] for k, v in arrays.items()}}, meta
                )
            bar.update(len(batch))
            bar.set_postfix_str(f"{(writer.num_bytes + bytes_before) / 1e6:.1f} MB written")
    except BaseException:
        writer.close()  # keep the .partial file: a rerun truncates and rewrites it
        raise
    info = writer.commit(first_index=indices.start)
    write_atomic(_sidecar(out_dir, index), json.dumps(dataclasses.asdict(info)))
    return info


def _cast_checked(array: np.ndarray, dtype: str, name: str, start: int) -> dict[str, np.ndarray]:
    """A batch's feature `name` (B, G, width) float32 as stored: {name: cast} or, for float8_e4m3fn,
    {name: (B, G, width) uint8 codes, "<name>_scale": (B, G) float32 row scales}.

    Raises:
        ValueError: if the cast holds NaN/Inf; for float8, if the features are not finite before
            quantising or exceed float16's range (the reader dequantises into float16 batches).
    """
    if dtype == FP8_DTYPE:
        where = f"field {name!r} of the batch starting at sample {start}"
        finite = np.isfinite(array)
        if not finite.all():
            raise ValueError(
                f"{where} holds {finite.size - np.count_nonzero(finite)} non-finite values (NaN/Inf) before "
                f"quantising to {dtype}: the target produced them; check the target and its dtype"
            )
        largest = float(np.abs(array).max()) if array.size else 0.0
        if largest > FLOAT16_MAX:
            raise ValueError(
                f"{where} has max |x| = {largest:.3g}, beyond float16's 65504, the dtype {dtype} features are "
                "read back in; use feature_dtype: float32"
            )
        codes, scales = quantize_rows(array)
        return {name: codes, scale_member(name): scales}
    cast = array.astype(dtype)
    if not np.isfinite(cast).all():
        raise ValueError(
            f"field {name!r} of the batch starting at sample {start} is not finite after casting "
            f"to {dtype} (max |x| = {np.abs(array).max():.3g}); use feature_dtype: float32"
        )
    return {name: cast}


def _sidecar(out_dir: Path, index: int) -> Path:
    return out_dir / WORK_DIR / (shard_name(index).removesuffix(".tar") + ".json")


def _shard_info(out_dir: Path, index: int, first_index: int) -> ShardInfo | None:
    """A finished shard's info from its sidecar, rebuilt by re-reading the tar if the sidecar is missing."""
    path, sidecar = out_dir / shard_name(index), _sidecar(out_dir, index)
    if not path.exists():
        return None
    if sidecar.exists():
        try:
            return ShardInfo.from_dict(json.loads(sidecar.read_text()), source=str(sidecar))
        except json.JSONDecodeError as error:
            raise ValueError(f"{sidecar} is not valid JSON ({error}); delete it to rebuild it from {path}") from None
    sha256 = hashlib.sha256()
    count = sum(1 for _ in iter_raw_samples(path, sha256))  # killed between rename and sidecar write
    info = ShardInfo(path.name, count, sha256.hexdigest(), path.stat().st_size, first_index)
    write_atomic(sidecar, json.dumps(dataclasses.asdict(info)))
    return info


def _check_or_write_header(job: _Job) -> None:
    path = Path(job.config.out_dir) / WORK_DIR / "job.json"
    text = job.header.to_json()
    old, new = (json.loads(path.read_text()) if path.exists() else None), json.loads(text)
    if old is not None:
        old.setdefault("features", "full")  # job files written before the field existed
    if old is not None and old.get("schema_version") == 1:  # begun before the checkpoint was recorded:
        old_v1, new_v1 = dict(old), {k: v for k, v in new.items() if k != "checkpoint"}  # it stays unknown
        old_v1["schema_version"] = new_v1["schema_version"] = 1
        if old_v1 == new_v1:
            return
    if old is not None and old != new:
        changed = [k for k in new if old.get(k) != new.get(k)]
        weights = (
            f" (checkpoint: begun with {old.get('checkpoint')}, now {new['checkpoint']})"
            if "checkpoint" in changed
            else ""
        )
        raise ValueError(
            f"{job.config.out_dir} holds an extraction with different settings ({', '.join(changed)} "
            f"changed){weights}; resume with the original config and weights or choose a new out_dir"
        )
    write_atomic(path, text)


def merge_manifest(out_dir: str | Path, require_complete: bool = False) -> Manifest | None:
    """Write manifest.json once every shard is finished; returns None (or raises) while some are missing."""
    out_dir = Path(out_dir)
    job_path = out_dir / WORK_DIR / "job.json"
    if not job_path.exists():
        raise FileNotFoundError(f"{job_path} does not exist: {out_dir} is not an extraction output folder")
    try:
        values = json.loads(job_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{job_path} is not valid JSON ({error}); rerun the extraction to rewrite it") from None
    manifest = Manifest.from_dict(values, source=str(job_path))
    num_shards = math.ceil(manifest.num_samples / manifest.samples_per_shard)
    infos = [_shard_info(out_dir, i, i * manifest.samples_per_shard) for i in range(num_shards)]
    missing = [shard_name(i) for i, info in enumerate(infos) if info is None]
    if missing:
        if require_complete:
            raise ValueError(
                f"{out_dir}: {len(missing)} of {num_shards} shards are not finished "
                f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); rerun the extraction"
            )
        return None
    manifest.shards = [info for info in infos if info is not None]
    write_atomic(out_dir / "manifest.json", manifest.to_json())
    return manifest


def run_extraction(
    config: ExtractConfig,
    target: ImageTarget | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    progress: bool = True,
    checkpoint: CheckpointIdentity | None = None,
) -> Manifest | None:
    """Write this rank's unfinished shards, then the manifest if every shard is done.

    Args:
        config: the job.
        target: the model; None loads `config.target` from the registry.
        rank, world_size: default to torchrun's RANK and WORLD_SIZE (0 and 1 without torchrun).
        checkpoint: the weights a given `target` was loaded from, for the manifest; with `target` None it is
            `checkpoint_identity(config.target, config.target_options)`, taken once the target is loaded (so
            a hub id's files are in the cache, and every rank, resumed or not, records the same). A target
            passed without it (one built in code) is recorded as unknown.
    """
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1} (RANK / WORLD_SIZE)")
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    if target is None:
        target = load_target(config.target, **process_target_options(config.target, config.target_options))
        checkpoint = checkpoint_identity(config.target, config.target_options)  # after loading: a hub id is cached
    job = build_job(config, target, checkpoint)
    out_dir = Path(config.out_dir)
    (out_dir / WORK_DIR).mkdir(parents=True, exist_ok=True)
    _check_or_write_header(job)
    mine = [i for i in range(rank, job.num_shards, world_size)]
    todo = [i for i in mine if not (out_dir / shard_name(i)).exists()]
    done_samples = sum(len(job.shard_range(i)) for i in mine if i not in todo)
    bar = tqdm(
        total=sum(len(job.shard_range(i)) for i in mine),
        initial=done_samples,
        unit="sample",
        desc=f"extract rank {rank}/{world_size}",
        disable=not progress,
        dynamic_ncols=True,
    )
    written, started = 0, time.perf_counter()
    with bar:
        for index in todo:
            written += _write_shard(job, target, index, bar, written).num_bytes
    if todo:
        seconds, count = time.perf_counter() - started, sum(len(job.shard_range(i)) for i in todo)
        print(
            f"rank {rank}: wrote {count} samples in {len(todo)} shards, {written / 1e6:.1f} MB "
            f"({written / count / 1e3:.1f} KB per sample, features: {config.features}), in {seconds:.1f} s "
            f"({count / seconds:.2f} samples/s); {len(mine) - len(todo)} shards were already done",
            file=sys.stderr,
        )
    manifest = merge_manifest(out_dir)
    if manifest is None:
        print(
            f"rank {rank}: my {len(mine)} shards are done; the last rank to finish writes manifest.json "
            f"(or run `python -m data.extract --merge {out_dir}`)",
            file=sys.stderr,
        )
    return manifest


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, help="YAML extraction config (see configs/extract_toy.yaml)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. batch_size=8 prompts.count=16")
    parser.add_argument("--validate", type=Path, metavar="DIR", help="re-read every shard of DIR and check it")
    parser.add_argument("--merge", type=Path, metavar="DIR", help="write DIR/manifest.json from finished shards")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.add_argument("--print_config", action="store_true", help="print the resolved config and stop")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    known = {flag for action in parser._actions for flag in action.option_strings}
    try:
        own, flags = split_dotted_flags(sys.argv[1:] if argv is None else list(argv), known)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    args = parser.parse_args(own)
    try:
        args.overrides = [*args.overrides, *flags]
        if args.validate:
            report = validate_dataset(args.validate, progress=not args.no_progress)
            print(
                f"{args.validate}: OK, {report['shards']} shards, {report['samples']} samples, "
                f"{report['bytes'] / 1e6:.1f} MB"
            )
        elif args.merge:
            manifest = merge_manifest(args.merge, require_complete=True)
            assert manifest is not None
            print(
                f"wrote {args.merge / 'manifest.json'}: {len(manifest.shards)} shards, {manifest.num_samples} samples"
            )
        else:
            if args.config is None and not args.overrides:
                raise ValueError("give --config FILE (and optional key=value overrides), --validate DIR or --merge DIR")
            config = load_config(resolve_config_path(args.config) if args.config else None, args.overrides)
            if args.print_config:
                print(yaml.safe_dump(dataclasses.asdict(config), sort_keys=False), end="")
                return 0
            manifest = run_extraction(config, progress=not args.no_progress)
            if manifest is not None:
                print(f"wrote {manifest.num_samples} samples in {len(manifest.shards)} shards to {config.out_dir}")
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
