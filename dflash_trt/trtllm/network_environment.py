"""The build's hand-over to the network through the environment: `dflash-trt build` sets the variables
(`build_environment`) and the network reads them back (`engine_schedule`, `engine_tree_nodes`)."""

from __future__ import annotations

import os
import shlex

from dflash_trt.draft_schedule import AUTO, DraftLenSchedule
from dflash_trt.errors import DFlashTrtError
from dflash_trt.inputs import DRAFT_LEN_SCHEDULE, DRAFT_TREE
from dflash_trt.trtllm.attention_route import TARGET_SM_ENV
from dflash_trt.trtllm.build_settings import EngineBuildSettings
from dflash_trt.trtllm.eagle_layout import check_tree_nodes

# The draft-length schedule trtllm-build builds into the network: the checkpoint's config.json (which trtllm-build
# reads) is the converter's and holds none, so `dflash-trt build` hands the resolved table over in this variable.
SCHEDULE_ENV = "DFLASH_TRT_DRAFT_LEN_SCHEDULE"
# The draft tree trtllm-build builds into the network: the checkpoint's config.json (which trtllm-build reads) is the
# converter's and holds none, so `dflash-trt build` hands the node count over in this variable.
TREE_ENV = "DFLASH_TRT_DRAFT_TREE"


def build_environment(settings: EngineBuildSettings) -> dict[str, str]:
    """The variables the model class reads while trtllm-build builds it (the converted config.json trtllm-build loads
    holds none of them): the GPU's SM (its attention route), the draft-length schedule, and a draft tree's node
    count."""
    tree = {} if settings.draft_tree is None else {TREE_ENV: str(settings.draft_tree)}
    return {TARGET_SM_ENV: str(settings.route.sm), SCHEDULE_ENV: settings.draft_len_schedule.text(), **tree}


def environment_prefix(environment: dict[str, str]) -> str:
    return "".join(f"{name}={shlex.quote(value)} " for name, value in environment.items())


def engine_schedule(text: str | None, max_draft_len: int) -> DraftLenSchedule:
    """The schedule a network is built with: `text` (the `draft_len_schedule` key of an engine's config.json, or of
    the config the emulation builds), else `$DFLASH_TRT_DRAFT_LEN_SCHEDULE` (set by `dflash-trt build` for
    trtllm-build), else `none`. `auto` must already be resolved into a table: the network cannot plan."""
    source = "draft_len_schedule" if text is not None else SCHEDULE_ENV
    value = text if text is not None else os.environ.get(SCHEDULE_ENV, "none")
    schedule = DRAFT_LEN_SCHEDULE.check(value, source)
    if schedule == AUTO:
        raise DFlashTrtError(
            f"{source} is auto, which only dflash-trt build and plan resolve (for a GPU, TP and acceptance); "
            "give the table they print"
        )
    assert isinstance(schedule, DraftLenSchedule)
    return schedule.fitted_to(max_draft_len, source)


def engine_tree_nodes(value: int | None, num_drafts: int, dflash2: bool) -> int:
    """Nodes of the draft tree a network is built with, 0 for the chain: `value` (the `draft_tree` key of an
    engine's config.json, or of the config the emulation builds), else `$DFLASH_TRT_DRAFT_TREE` (set by `dflash-trt
    build` for trtllm-build), else the chain."""
    if value is not None:
        return check_tree_nodes(DRAFT_TREE.check(value, "draft_tree"), num_drafts, dflash2, "draft_tree")
    text = os.environ.get(TREE_ENV)
    if text is None:
        return 0
    try:
        nodes = DRAFT_TREE.parse(text)
    except ValueError:
        raise DFlashTrtError(f"{TREE_ENV} must be {DRAFT_TREE.describe()}, got {text!r}") from None
    return check_tree_nodes(DRAFT_TREE.check(nodes, TREE_ENV), num_drafts, dflash2, TREE_ENV)
