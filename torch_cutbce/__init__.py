"""torch-cutbce: exact full-catalog binary cross-entropy without materializing `[N, V]` logits."""

from cutbce_common.focal import Focal
from torch_cutbce.engines import resolved_backend
from torch_cutbce.functional import BACKENDS, cut_bce_with_logits
from torch_cutbce.metrics import CutBCEMetrics
from torch_cutbce.module import CutBCEWithLogitsLoss
from torch_cutbce.special_rows import CatalogArguments, SpecialRows, without_padding_row, without_special_rows
from torch_cutbce.reference import dense_bce_with_logits
from torch_cutbce.targets import ids_to_multi_hot, multi_hot_to_ids
from torch_cutbce.topk import full_catalog_topk

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "CatalogArguments",
    "CutBCEMetrics",
    "CutBCEWithLogitsLoss",
    "Focal",
    "cut_bce_with_logits",
    "dense_bce_with_logits",
    "full_catalog_topk",
    "ids_to_multi_hot",
    "multi_hot_to_ids",
    "SpecialRows",
    "resolved_backend",
    "without_padding_row",
    "without_special_rows",
]
