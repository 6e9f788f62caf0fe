"""A data set's rows, whatever it is stored as: JSONL, Parquet, or a Hugging Face `datasets`
directory written by `Dataset.save_to_disk`.

Users bring data in the form their field keeps it in: DeepScaleR and DeepCoder ship JSONL, the
Hub's datasets are Parquet, and a `datasets` pipeline ends in `save_to_disk`. Each format is read
by its own library (pyarrow for Parquet, `datasets.load_from_disk` for a saved directory, which
reads local Arrow files and never the network), and every reader yields the same thing: one
`(where, row, problem)` per row, `where` being what a bad row is reported as — `file:line` for
JSONL, `file: row N` (N from 0, as `ds[N]` numbers it) for the columnar formats — so the loader
(dataset.py) applies one set of rules (the column mapping, skip-and-report) to every format.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
BATCH_ROWS = 1024
WHAT_WORKS = "a .jsonl or .parquet file, or a directory written by datasets' save_to_disk"


class DataFileError(ValueError):
    """The data set as a whole cannot be read (not one bad row: those are skipped)."""


@dataclass
class DataFile:
    path: Path
    format: str                  # jsonl | parquet | datasets
    columns: list[str] | None    # the columnar formats' schema; JSONL rows have none in common
    num_rows: int | None         # known without reading the rows (the columnar formats)

    def rows(self) -> Iterator[tuple[str, object, str | None]]:
        """(where, row, None) for each row, or (where, None, why) for one that cannot be read."""
        if self.format == "jsonl":
            return _jsonl_rows(self.path)
        if self.format == "parquet":
            return _parquet_rows(self.path)
        return _datasets_rows(self.path)

    def count_rows(self) -> int:
        """Rows of the data set (JSONL: its non-empty lines, read once)."""
        if self.num_rows is not None:
            return self.num_rows
        with open(self.path, "rb") as f:
            return sum(1 for raw in f if raw.strip())


def looks_like_hub_name(text: str) -> bool:
    """`owner/name`, as the Hugging Face Hub names data sets and models (a path that does not
    exist may be one the user expected to be downloaded)."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", text) is not None and not text.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES)


def open_data(path: str | Path) -> DataFile:
    """The data set at `path`, its format told by what it is: raises DataFileError saying why a
    path is none of the formats, or cannot be opened."""
    path = Path(path)
    if not path.exists():
        hint = (f"; a Hugging Face Hub name? runs read local files only: save it once where the network is, "
                f"datasets.load_dataset({str(path)!r}, split=...).save_to_disk(DIR), and give DIR "
                f"(docs/running.md, Data)") if looks_like_hub_name(str(path)) else ""
        raise DataFileError(f"{path}: no such file or directory{hint}")
    if path.is_dir():
        return _open_datasets_dir(path)
    if path.suffix in JSONL_SUFFIXES:
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as e:
            raise DataFileError(f"{path}: cannot read it ({e.strerror or e})") from None
        return DataFile(path, "jsonl", None, None)
    if path.suffix in PARQUET_SUFFIXES:
        return _open_parquet(path)
    raise DataFileError(f"{path}: not a data set format Tandem reads ({WHAT_WORKS})")


def _jsonl_rows(path: Path):
    with open(path, "rb") as f:      # bytes: one line that is not UTF-8 is a bad row, not a bad file
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield where, None, f"{where}: not UTF-8 (byte {e.start})"
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line), None
            except json.JSONDecodeError as e:
                yield where, None, f"{where}: not JSON ({e.msg})"


def _open_parquet(path: Path) -> DataFile:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise DataFileError(f"{path}: cannot read it as Parquet ({e})") from None
    return DataFile(path, "parquet", list(f.schema_arrow.names), f.metadata.num_rows)


def _parquet_rows(path: Path):
    import pyarrow.parquet as pq

    yield from _numbered(path, (batch.to_pylist() for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS)))


def _numbered(path: Path, batches):
    """The rows of a columnar data set's batches, numbered; a batch that cannot be decoded (a
    damaged file: unlike a bad JSONL line, no row of it can be told apart) stops the reading."""
    import pyarrow as pa

    index = 0
    try:
        for rows in batches:
            for row in rows:
                yield f"{path}: row {index}", row, None
                index += 1
    except (OSError, pa.ArrowException) as e:
        raise DataFileError(f"{path}: cannot read it past row {index} ({e})") from None


def _open_datasets_dir(path: Path) -> DataFile:
    """A `Dataset.save_to_disk` directory. A DatasetDict's directory holds one such directory per
    split: the error names them, so the user points at one (`data/gsm8k/train`)."""
    if (path / "dataset_dict.json").exists():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        except (OSError, ValueError, AttributeError):
            splits = []
        example = f" (e.g. {path / splits[0]})" if splits else ""
        raise DataFileError(f"{path}: a DatasetDict with splits {', '.join(splits) or '?'}; name the split's "
                            f"directory{example}")
    if not (path / "state.json").exists():
        raise DataFileError(f"{path}: a directory, but not one written by save_to_disk (no state.json); "
                            f"expected {WHAT_WORKS}")
    ds = _load_from_disk(path)
    return DataFile(path, "datasets", list(ds.column_names), ds.num_rows)


def _load_from_disk(path: Path):
    import datasets

    datasets.disable_progress_bars()      # a role's log is no terminal
    try:
        return datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - whatever the library raises on a damaged directory
        raise DataFileError(f"{path}: cannot load it with datasets.load_from_disk "
                            f"({type(e).__name__}: {e})") from None


def _datasets_rows(path: Path):
    tables = _load_from_disk(path).with_format("arrow").iter(batch_size=BATCH_ROWS)
    yield from _numbered(path, (table.to_pylist() for table in tables))
