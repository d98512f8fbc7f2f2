"""The `data` section: where the data is (checked when opened: paths.py), its held-out sets, the decoding limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from vtrain.config.fields import DINO_ONLY, METRIC_ONLY, NO_FLAG, Section
from vtrain.config.model import MIN_DETECTION_SIZE

DEMO_DATA = "demo"  # --data demo: the task's built-in data set (data/demo.py)
# the training images of `--data demo` per task (data/demo_faces.py: 200 identities x 12; data/demo_shapes.py's
# train split; tests/core/test_config.py checks both), so a batch larger than the demo set is one line at once
DEMO_TRAIN_IMAGES = {"metric": 200 * 12, "dino": 240}
# PIL's own decompression-bomb limit (PIL.Image.MAX_IMAGE_PIXELS, 1024^3 / 4 / 3: a 1 GB RGB image at 32 bits per
# pixel); torchvision's decoders have none, so vtrain applies it to every image it decodes (docs/input_limits.md)
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
MAX_IMAGE_PIXELS_CEILING = 1 << 32  # 12 GiB as uint8 RGB; libjpeg's 65500 x 65500 is 4.29e9 pixels
# sampled held-out pairs of each kind: 10 million resolve FAR 1e-6 with ten false accepts (docs/face.md §5) and
# stay a few hundred MB of indices and scores (docs/input_limits.md)
MAX_SAMPLED_PAIRS = 10_000_000


@dataclass
class DataConfig(Section):
    SECTION = "data"

    path: str = field(default=DEMO_DATA, metadata={"flag": "--data"})
    """`demo` (built-in synthetic data); a directory (metric: an insightface RecordIO dir with train.rec + train.idx +
    property, or train/<identity>/*.jpg (+ val/, pairs.txt); DINO: COCO layout); `hf:PATH`, a Hugging Face datasets
    folder saved with save_to_disk or parquet files (docs/hf_datasets.md); or (metric eval only) a verification
    `.bin` pack (docs/face_data.md)."""
    num_workers: int = 2
    """DataLoader workers per process."""
    val_path: str | None = field(default=None, metadata={"flag": "--val-data", **METRIC_ONLY})
    """Held-out identity tree for verification; defaults to <data>/val when it exists."""
    pairs_file: str | None = field(default=None, metadata={"flag": "--pairs", **METRIC_ONLY})
    """Verification pairs file (`path1 path2 1|0` per line, paths relative to the file); else pairs are sampled."""
    max_impostor_pairs: int = field(default=200_000, metadata={**NO_FLAG, **METRIC_ONLY})
    """Held-out identities: impostor pairs scored, all of them or a seeded uniform sample of this many."""
    max_genuine_pairs: int = field(default=200_000, metadata={**NO_FLAG, **METRIC_ONLY})
    """Held-out identities: genuine pairs scored, all of them or a seeded uniform sample of this many (an identity
    with thousands of images has millions; 200,000 measure a TAR to about +-0.1%)."""
    val_targets: list[str] | None = field(default=None, metadata=METRIC_ONLY)
    """Metric: verification packs to evaluate on, insightface style, comma-separated: `lfw` is <data>/lfw.bin,
    `x.bin` a path. Default: every *.bin beside a train.rec; an empty value evaluates on none."""
    train_ann: str | None = field(default=None, metadata=DINO_ONLY)
    """Detection: COCO annotation JSON for training (default: <data>/annotations/instances_train2017.json)."""
    train_images: str | None = field(default=None, metadata=DINO_ONLY)
    """Detection: training image folder (default: <data>/train2017)."""
    val_ann: str | None = field(default=None, metadata=DINO_ONLY)
    """Detection: COCO annotation JSON for evaluation (default: <data>/annotations/instances_val2017.json)."""
    val_images: str | None = field(default=None, metadata=DINO_ONLY)
    """Detection: evaluation image folder (default: <data>/val2017)."""
    max_size: int | None = field(default=None, metadata=DINO_ONLY)
    """Detection: longest image side after resizing (default: image_size * 1333 / 800)."""
    skip_bad_images: bool = False
    """Skip unreadable image files (counted and named in the log at the end of each epoch) instead of stopping."""
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    """Largest image (width x height x frames) decoded; a larger one is refused before decoding, read from its
    header (or skipped with --skip-bad-images). Default: PIL's decompression-bomb limit, 89478485 pixels
    (docs/input_limits.md); also on `eval` and `predict`."""

    def __post_init__(self) -> None:
        self._check_text()
        check = self._check
        check(0 <= self.num_workers <= 256, "num_workers", f"must be in 0..256, got {self.num_workers}")
        if self.val_targets is not None:  # `lfw, agedb_30` from a flag or YAML; also built directly by `vtrain eval`
            items = self.val_targets.split(",") if isinstance(self.val_targets, str) else self.val_targets
            self.val_targets = [t.strip() for t in items if t.strip()]
        for key in ("max_impostor_pairs", "max_genuine_pairs"):  # every rank holds the pairs, rank 0 their scores
            value = getattr(self, key)
            check(0 < value <= MAX_SAMPLED_PAIRS, key, f"must be in 1..{MAX_SAMPLED_PAIRS}, got {value}")
        check(1 <= self.max_image_pixels <= MAX_IMAGE_PIXELS_CEILING, "max_image_pixels",
              f"must be in 1..{MAX_IMAGE_PIXELS_CEILING} pixels, got {self.max_image_pixels}")
        check(self.max_size is None or MIN_DETECTION_SIZE <= self.max_size <= 16384, "max_size",
              f"must be in {MIN_DETECTION_SIZE}..16384 (the coarsest DINO feature stride is 64), got {self.max_size}")
