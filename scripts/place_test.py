"""Place test files written at the top of tests/ into the layout that mirrors the package.

    python scripts/place_test.py                 # every tests/test_*.py: show where it goes
    python scripts/place_test.py --move          # git mv each one there and fix its imports
    python scripts/place_test.py tests/test_x.py --move

The rule (tests/<package>/test_<module>.py, slow end-to-end suites in tests/system/):
- a name of the layout before the move (`test_view_diff.py`, `test_writer.py`, ...) goes where that file went (`MOVED`);
- `test_<package>_<module>.py` goes to `tests/<package>/test_<module>.py` (`plan_` means planning, `view_` explore);
- `test_trust_<rest>.py` is placed as `test_<rest>.py` would be;
- `test_gguf_*` and `test_pth_*` go to tests/output/ whole, `test_remote_*` to tests/formats/, `test_docs_*` to tests/system/;
- a top-level module's name (`test_names.py`, `test_files_x.py`) goes to tests/core/.
Anything else is reported, not moved. Moving rewrites `from conftest import` to `from tests.conftest import`, imports
of moved test modules to their new names, and `Path(__file__).resolve().parent.parent` to `.parents[2]`.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
PACKAGES = ("formats", "mapper", "planning", "engine", "launch", "output", "explore", "training", "model_io", "widgets", "cli")
ALIASES = {"plan": "planning", "view": "explore"}
WHOLE = {"gguf": "output", "pth": "output", "remote": "formats", "docs": "system"}  # the prefix stays in the file name
CORE = ("architecture", "catalog", "dtypes", "errors", "names", "display", "files", "overflow", "iostats", "conversion", "digest")

# where each file of the layout before the move went (tests/<old>.py -> tests/<new>.py)
_TABLE = """
test_architecture core/test_architecture          test_display core/test_display
test_errors core/test_errors                      test_names core/test_names
test_file_safety core/test_files                  test_cast_safety core/test_overflow
test_formats_atorch formats/test_atorch           test_formats_dcp formats/test_dcp
test_formats_deepspeed formats/test_deepspeed     test_formats_megatron formats/test_megatron
test_formats_safetensors formats/test_safetensors test_formats_torch formats/test_torch_zip
test_formats_torch_sharded formats/test_torch_folder  test_index formats/test_shard_index
test_fuzz_readers formats/test_fuzz_readers       test_remote formats/test_remote
test_trust_remote formats/test_remote_limits      test_trust_remote_cache formats/test_remote_cache
test_trust_remote_config formats/test_remote_config  test_trust_remote_names formats/test_remote_names
test_trust_formats formats/test_untrusted         test_mapper_bind mapper/test_bind
test_mapper_export mapper/test_export             test_mapper_globs mapper/test_globs
test_mapper_inverse mapper/test_inverse           test_mapper_ops mapper/test_ops
test_mapper_presets mapper/test_presets           test_mapper_ranges mapper/test_ranges
test_mapper_target mapper/test_target             test_quantized mapper/test_quantized
test_trust_plan_quantized mapper/test_quantized_blocks  test_transformers_layout mapper/test_transformers_layout
test_peft_merge mapper/test_lora                  test_trust_peft mapper/test_adapter_config
test_trust_peft_tied mapper/test_lora_tied        test_trust_plan_suggest mapper/test_suggest
test_trust_plan_megatron mapper/test_megatron     test_trust_plan_function_ranks mapper/test_function
test_plan planning/test_plan                      test_plan_rss planning/test_rss
test_trust_remote_rss planning/test_rss_remote    test_plan_speed planning/test_speed
test_cast_batch planning/test_cast_batches        test_cast_runs planning/test_cast_runs
test_copy_runs planning/test_copy_runs            test_lanes planning/test_lanes
test_page_align planning/test_page_align          test_trust_plan_extras planning/test_extras
test_engine engine/test_rank                      test_cast_pipeline engine/test_bf16
test_committer engine/test_committer              test_copy_stretch engine/test_steps
test_local_launcher launch/test_launcher          test_trust_cli_launch launch/test_jobdir
test_trust_suite_signals launch/test_processes    test_writer output/test_safetensors
test_dcp_output output/test_dcp                   test_pth_output output/test_pth
test_trust_pth_tied output/test_pth_tied          test_output_registry output/test_registry
test_lock output/test_lock                        test_direct_io output/test_direct_io
test_gguf_output output/test_gguf                 test_gguf_hf_vocab output/test_gguf_hf_vocab
test_gguf_rss output/test_gguf_rss                test_gguf_fp8 output/test_gguf_fp8
test_trust_gguf_preset output/test_gguf_preset    test_trust_gguf_writer output/test_gguf_writer
test_trust_gguf_writer_split output/test_gguf_split  test_view explore/test_checkpoint
test_view_diff explore/test_diff                  test_view_layers explore/test_layers
test_view_stats explore/test_stats                test_verify_checksums explore/test_verify
test_training_convert training/test_extract       test_formats_lightning training/test_lightning
test_model_io model_io/test_load_save             test_model_io_meta_buffers model_io/test_buffers
test_widgets_background widgets/test_background   test_widgets_builder widgets/test_builder
test_widgets_explorer widgets/test_explorer       test_widgets_graph widgets/test_graph
test_widgets_plan widgets/test_plan_panel         test_widgets_run widgets/test_run_panel
test_widgets_table widgets/test_table             test_cli cli/test_commands
test_convert_cli cli/test_convert                 test_trust_cli cli/test_refusals
test_trust_cli_sources cli/test_sources           test_crash_safety system/test_crash_safety
test_distributed system/test_distributed          test_multinode system/test_multinode
test_model_io_distributed system/test_model_io_distributed  test_convert_transformers system/test_convert_transformers
test_benchmarks system/test_benchmarks            test_samples system/test_samples
test_hostile system/test_hostile
"""
MOVED = dict(re.findall(r"(test_\w+) (\w+/test_\w+)", _TABLE))


def place(stem: str) -> str | None:
    """The new place of tests/<stem>.py as '<folder>/test_<name>' (None when the rule does not say)."""
    if stem in MOVED:
        return MOVED[stem]
    rest = stem.removeprefix("test_").removeprefix("trust_")
    head, _, tail = rest.partition("_")
    if head in WHOLE:
        return f"{WHOLE[head]}/test_{rest}"
    package = ALIASES.get(head, head)
    if package in PACKAGES and tail:
        return f"{package}/test_{tail}"
    if head in CORE or rest in CORE:
        return f"core/test_{rest}"
    if rest.startswith("model_io_"):
        return f"model_io/test_{rest.removeprefix('model_io_')}"
    return None


def fix_imports(text: str) -> str:
    """A moved file's imports of conftest and of other test modules, and its repository path, one level deeper."""
    text = re.sub(r"^(\s*)from conftest import", r"\1from tests.conftest import", text, flags=re.M)

    def module(match: re.Match[str]) -> str:
        new = place(match.group(2))
        return f"{match.group(1)}from tests.{new.replace('/', '.')} import" if new else match.group(0)

    text = re.sub(r"^(\s*)from (test_\w+) import", module, text, flags=re.M)
    return text.replace("Path(__file__).resolve().parent.parent", "Path(__file__).resolve().parents[2]").replace(
        "Path(__file__).resolve().parents[1]", "Path(__file__).resolve().parents[2]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="test files at the top of tests/ (default: all of them)")
    parser.add_argument("--move", action="store_true", help="git mv them and fix their imports (default: only show)")
    args = parser.parse_args(argv)
    files = [f.resolve() for f in args.files] or sorted(TESTS.glob("test_*.py"))
    unplaced = 0
    for path in files:
        new = place(path.stem)
        target = TESTS / f"{new}.py" if new else None
        if target is None or target.exists():
            unplaced += 1
            print(f"{path.relative_to(REPO)}: " + ("no rule places it; choose by hand" if target is None else
                                                   f"{target.relative_to(REPO)} exists; merge the two by hand"))
            continue
        print(f"{path.relative_to(REPO)} -> {target.relative_to(REPO)}")
        if args.move:
            subprocess.run(["git", "mv", str(path), str(target)], cwd=REPO, check=True)
            target.write_text(fix_imports(target.read_text(encoding="utf-8")), encoding="utf-8")
    return 1 if unplaced else 0


if __name__ == "__main__":
    sys.exit(main())
