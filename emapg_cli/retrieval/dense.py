"""Dense retrieval: a sentence-transformers encoder and a FAISS inner-product index (the optional extra `dense`).

This is the only module that imports `faiss` and `sentence_transformers`, and only inside functions: without the
extra, everything else of emapg works and a dense index is one UserError ("pip install 'emapg[dense]'").

Conventions are e5's (Wang et al. 2022, "Text Embeddings by Weakly-Supervised Contrastive Pre-training"), as
Search-R1's retrieval server applies them to e5-base-v2 over wiki-18: passages are encoded as "passage: " + contents,
queries as "query: " + query (both prefixes are options, recorded in the manifest), mean pooling over the tokens
(what sentence-transformers builds for a plain transformers folder, and what e5-base-v2's own modules say), then L2
normalisation, so the index's inner product is the cosine similarity; texts are cut to `max_length` tokens (256, as
Search-R1's server and index builder use).

Index kinds (FAISS, metric inner product):
  * `flat`  - IndexFlatIP: exact, n x dim float32 in memory (wiki-18, 21M x 768: ~64 GB), the paper's choice;
  * `ivf`   - IndexIVFFlat: k-means into `nlist` lists (trained on the encoded passages), a query scans `nprobe`;
  * `ivfpq` - IndexIVFPQ: IVF whose vectors are product-quantised to `pq_m` bytes each (8 bits per sub-vector):
              wiki-18 in ~2 GB instead of 64 GB, at a recall cost (docs/search.md);
  * `hnsw`  - IndexHNSWFlat: a graph of `M` links per vector, a query explores `ef_search` candidates.

A dense index folder: `faiss.index`, the doc store (`docs.bin` + `docs.offsets.npy`, `retrieval/docstore.py`) and
`manifest.json` (format "emapg-dense/1": encoder, prefixes, pooling, dim, faiss kind and parameters, corpus sha256,
and the size and sha256 of every file). Built like the bm25 index: the folder is claimed and locked
(`outputs.claim_folder`, kind `retriever index`), written in a temporary folder beside it, the manifest last.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from emapg_cli.errors import UserError
from emapg_cli.fileio import sha256_file
from emapg_cli.retrieval.base import MANIFEST, Hit, file_table, hit_from_doc, is_json, read_index_manifest

FORMAT = "emapg-dense/1"
FAISS_FILE = "faiss.index"
KIND = "retriever index"  # the output-folder kind, shared with the bm25 index (outputs.claim_folder)
FAISS_KINDS = ("flat", "ivf", "ivfpq", "hnsw")
QUERY_PREFIX, PASSAGE_PREFIX = "query: ", "passage: "
MAX_LENGTH = 256
MISSING_EXTRA = "the dense retriever needs faiss and sentence-transformers: pip install 'emapg[dense]'"
#: The manifest's keys and their JSON types.
MANIFEST_KEYS: dict[str, Any] = {
    "format": str, "model": str, "query_prefix": str, "passage_prefix": str, "pooling": str, "normalize": bool,
    "max_length": int, "dim": int, "faiss": dict, "corpus": str, "corpus_sha256": str, "rows": int,
    "index_s": (int, float), "files": dict}
#: Each faiss kind's parameters (all integers >= 1).
FAISS_PARAMS = {"flat": (), "ivf": ("nlist", "nprobe"), "ivfpq": ("nlist", "nprobe", "pq_m"),
                "hnsw": ("M", "ef_construction", "ef_search")}
PQ_BITS = 8  # bits per product-quantiser code: 256 centroids per sub-vector, so k-means needs >= 256 passages
#: The type code faiss writes first in faiss.index for each kind (inner-product indexes, faiss/impl/index_write.cpp).
FOURCC = {"flat": b"IxFI", "ivf": b"IwFl", "ivfpq": b"IwPQ", "hnsw": b"IHNf"}


def deps():
    """(faiss, sentence_transformers), or the one-line UserError naming the extra that installs them."""
    try:
        import faiss
        import sentence_transformers
    except ImportError:
        raise UserError(MISSING_EXTRA) from None
    return faiss, sentence_transformers


def load_encoder(model: str, max_length: int = MAX_LENGTH, device: Optional[str] = None):
    """A SentenceTransformer from a hub name or a local folder; a plain transformers folder gets mean pooling."""
    import logging

    if not model.strip():  # sentence-transformers would build an empty model from ""
        raise UserError("the dense encoder's name is empty: give a local encoder folder or a hub name (--dense MODEL)")

    from emapg_cli.hf_quiet import quiet_transformers

    st = deps()[1]
    quiet_transformers()
    level = logging.getLogger("sentence_transformers").level
    logging.getLogger("sentence_transformers").setLevel(logging.ERROR)  # "creating a new one with mean pooling"
    try:
        encoder = st.SentenceTransformer(model, device=device)
    except Exception as e:  # noqa: BLE001  a missing folder, no network, a broken config: whatever the library raises
        raise UserError(f"cannot load the encoder {model!r} ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})") from None
    finally:
        logging.getLogger("sentence_transformers").setLevel(level)
    encoder.max_seq_length = max_length
    return encoder


def pooling_of(encoder) -> str:
    """The pooling mode of the encoder's Pooling module ("mean" for e5), or "none" without one."""
    for module in encoder:
        if type(module).__name__ == "Pooling":
            mode = getattr(module, "pooling_mode", None)  # sentence-transformers >= 6; a method before
            return str(mode if isinstance(mode, str) else module.get_pooling_mode_str())
    return "none"


def dim_of(encoder) -> int:
    """The encoder's embedding size (sentence-transformers renamed the method in 6.0)."""
    get = getattr(encoder, "get_embedding_dimension", None) or encoder.get_sentence_embedding_dimension
    return int(get())


def encode(encoder, texts: list[str], prefix: str, batch_size: int = 64):
    """float32 [len(texts), dim], rows L2-normalised: `encoder(prefix + text)` pooled as the encoder says."""
    import numpy as np

    vectors = encoder.encode([prefix + t for t in texts], batch_size=batch_size, normalize_embeddings=True,
                             convert_to_numpy=True, show_progress_bar=False)
    return np.ascontiguousarray(vectors, dtype=np.float32)  # [n, dim]


def default_nlist(rows: int) -> int:
    """4·sqrt(rows) inverted lists (FAISS's guideline is 4-16·sqrt(n)), at most rows/39 so that k-means has the 39
    training points per centroid FAISS asks for, and at least 1."""
    return max(1, min(int(4 * rows ** 0.5), rows // 39))


def faiss_params(kind: str, rows: int, nlist: Optional[int] = None, nprobe: Optional[int] = None,
                 hnsw_m: Optional[int] = None, ef_search: Optional[int] = None, pq_m: Optional[int] = None,
                 dim: Optional[int] = None) -> dict[str, Any]:
    """The manifest's `faiss` entry {"kind", parameters...}; a parameter of another kind is a UserError, and so is
    a `pq_m` that does not divide `dim` (checked when `dim` is given)."""
    if kind not in FAISS_KINDS:
        raise UserError(f"--faiss {kind!r}: expected one of {', '.join(FAISS_KINDS)}")
    given = {"--nlist": (nlist, ("ivf", "ivfpq")), "--nprobe": (nprobe, ("ivf", "ivfpq")), "--pq-m": (pq_m, ("ivfpq",)),
             "--hnsw-m": (hnsw_m, ("hnsw",)), "--ef-search": (ef_search, ("hnsw",))}
    for option, (value, owners) in given.items():
        if value is not None and kind not in owners:
            raise UserError(f"{option} applies to --faiss {' or '.join(owners)}, not {kind}")
    if kind in ("ivf", "ivfpq"):
        n = nlist or default_nlist(rows)
        if n > rows:
            raise UserError(f"--nlist {n} is more than the corpus's {rows} rows")
        params = {"kind": kind, "nlist": n, "nprobe": min(nprobe or 32, n)}
        if kind == "ivf":
            return params
        if rows < 1 << PQ_BITS:
            raise UserError(f"--faiss ivfpq needs at least {1 << PQ_BITS} passages to train its quantiser (the corpus has {rows})")
        m = pq_m or (dim // 8 if dim and dim % 8 == 0 else 1)  # 1 byte per 8 dimensions: 96 for e5-base's 768
        if dim and dim % m:
            raise UserError(f"--pq-m {m} does not divide the encoder's dimension {dim}")
        return {**params, "pq_m": m}
    if kind == "hnsw":
        return {"kind": kind, "M": hnsw_m or 32, "ef_construction": 40, "ef_search": ef_search or 128}
    return {"kind": kind}


def new_index(params: dict[str, Any], dim: int):
    """An empty FAISS index of `params["kind"]` over `dim`-vectors, metric inner product."""
    faiss = deps()[0]
    if params["kind"] in ("ivf", "ivfpq"):
        quantizer = faiss.IndexFlatIP(dim)  # the index keeps a reference to it
        if params["kind"] == "ivfpq":
            return faiss.IndexIVFPQ(quantizer, dim, params["nlist"], params["pq_m"], PQ_BITS, faiss.METRIC_INNER_PRODUCT)
        return faiss.IndexIVFFlat(quantizer, dim, params["nlist"], faiss.METRIC_INNER_PRODUCT)
    if params["kind"] == "hnsw":
        index = faiss.IndexHNSWFlat(dim, params["M"], faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = params["ef_construction"]
        return index
    return faiss.IndexFlatIP(dim)


def set_search_params(index, params: dict[str, Any]) -> None:
    """nprobe (IVF, IVF-PQ) / efSearch (HNSW) from the manifest, on a loaded index."""
    if params["kind"] in ("ivf", "ivfpq"):
        index.nprobe = params["nprobe"]
    elif params["kind"] == "hnsw":
        index.hnsw.efSearch = params["ef_search"]


def train_size(rows: int, nlist: int) -> int:
    """Training points for IVF k-means: 256 per list (FAISS warns under 39), at most 2^20 unless 39 per list needs
    more, and at most the corpus."""
    return min(rows, max(39 * nlist, min(256 * nlist, 1 << 20)))


def _fill(index, store, encoder, prefix: str, batch_size: int, params: dict, tmp: Path, advance) -> None:
    """Encode every row of `store` in chunks of 16 batches and add them to `index` (IVF, IVF-PQ: first into a
    float32 memmap on disk, then trained on a sample drawn from it, `train_size`, then added)."""
    import numpy as np

    rows, chunk = len(store), batch_size * 16
    spill = None
    if params["kind"] in ("ivf", "ivfpq"):
        spill = np.lib.format.open_memmap(tmp / "vectors.tmp.npy", mode="w+", dtype=np.float32, shape=(rows, index.d))
    for s in range(0, rows, chunk):
        part = [d["contents"] for d in store.get_many(list(range(s, min(s + chunk, rows))))]
        vectors = encode(encoder, part, prefix, batch_size)  # [chunk, dim]
        if spill is None:
            index.add(vectors)
        else:
            spill[s:s + len(part)] = vectors
        advance(len(part))
    if spill is not None:
        sample = np.random.default_rng(0).choice(rows, size=train_size(rows, params["nlist"]), replace=False)
        index.train(np.ascontiguousarray(spill[np.sort(sample)]))  # [sample, dim]
        for s in range(0, rows, 1 << 16):
            index.add(np.ascontiguousarray(spill[s:s + (1 << 16)]))
        del spill
        (tmp / "vectors.tmp.npy").unlink()


def build_dense_index(corpus: Path, out: Path, model: str, *, kind: str = "flat", batch_size: int = 64,
                      query_prefix: str = QUERY_PREFIX, passage_prefix: str = PASSAGE_PREFIX,
                      max_length: int = MAX_LENGTH, nlist: Optional[int] = None, nprobe: Optional[int] = None,
                      hnsw_m: Optional[int] = None, ef_search: Optional[int] = None, pq_m: Optional[int] = None,
                      progress: Optional[Callable[[int], Callable[[int], None]]] = None) -> dict:
    """Encode `corpus` with `model` into a FAISS index in the new (or empty) folder `out`; returns the manifest.

    Two passes over the corpus file: the rows stream into the doc store (`iter_corpus`, validated), then the
    store is read back in chunks to encode. Memory: the FAISS index (flat: rows x dim x 4 bytes) and one chunk.
    progress(total) -> advance(k), called per encoded chunk.
    """
    import os
    import shutil
    import tempfile

    from emapg_cli.outputs import claim_folder, marker_kind
    from emapg_cli.retrieval.corpus import iter_corpus
    from emapg_cli.retrieval.docstore import DocStore, write_docstore

    faiss_params(kind, 1 << 30, nlist, nprobe, hnsw_m, ef_search, pq_m)  # option mistakes first, with or without the extra
    faiss = deps()[0]
    out, corpus = Path(out), Path(corpus)
    if (out / MANIFEST).is_file() and marker_kind(out) == KIND:
        raise UserError(f"{out} already holds an index; choose a new --out folder")
    with claim_folder(out, KIND, fresh=True):
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))  # ours alone: a unique new name
        try:
            rows = write_docstore(iter_corpus(corpus), tmp)
            encoder = load_encoder(model, max_length)
            dim = dim_of(encoder)
            params = faiss_params(kind, rows, nlist, nprobe, hnsw_m, ef_search, pq_m, dim)
            index = new_index(params, dim)
            store = DocStore.open(tmp)
            try:
                _fill(index, store, encoder, passage_prefix, batch_size, params, tmp,
                      progress(rows) if progress else (lambda k: None))
            finally:
                store.close()
            faiss.write_index(index, str(tmp / FAISS_FILE))
            local = Path(model).expanduser()
            manifest = {
                "format": FORMAT, "model": str(local.resolve()) if local.is_dir() else model,
                "query_prefix": query_prefix, "passage_prefix": passage_prefix, "pooling": pooling_of(encoder),
                "normalize": True, "max_length": max_length, "dim": dim, "faiss": params,
                "corpus": str(corpus), "corpus_sha256": sha256_file(corpus), "rows": rows,
                "index_s": time.perf_counter() - t0, "files": file_table(tmp),
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
            for name in (*manifest["files"], MANIFEST):  # the manifest last: a folder without one is no index
                os.replace(tmp / name, out / name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # only the folder mkdtemp made for this call
    return manifest


def is_dense_index(folder: Path) -> bool:
    """Whether `folder/manifest.json` says format emapg-dense/* (anything unreadable: False, the bm25 loader reports it)."""
    try:
        manifest = json.loads((Path(folder) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(manifest, dict) and str(manifest.get("format", "")).startswith("emapg-dense/")


def _bad(folder: Path, what: str) -> UserError:
    return UserError(f"{folder}: broken dense index: {what} (rebuild it with `emapg retriever index CORPUS --out DIR --dense MODEL`)")


def read_manifest(folder: Path) -> dict:
    """The manifest of dense index `folder`, its keys, types and faiss parameters checked (one-line UserError)."""
    manifest = read_index_manifest(folder, FORMAT, MANIFEST_KEYS, lambda what: _bad(folder, what))
    for key in ("rows", "dim", "max_length"):
        if manifest[key] < 1:
            raise _bad(folder, f"{MANIFEST}: {key} is {manifest[key]}")
    if not manifest["model"].strip():
        raise _bad(folder, f"{MANIFEST}: model (the encoder) is empty")
    params = manifest["faiss"]
    if params.get("kind") not in FAISS_KINDS:
        raise _bad(folder, f"{MANIFEST}: faiss.kind is {str(params.get('kind'))[:40]!r}, not one of {', '.join(FAISS_KINDS)}")
    wanted = {"kind", *FAISS_PARAMS[params["kind"]]}
    if set(params) != wanted or not all(is_json(params[k], int) and params[k] >= 1 for k in wanted - {"kind"}):
        raise _bad(folder, f"{MANIFEST}: faiss of kind {params['kind']} needs exactly {', '.join(sorted(wanted - {'kind'})) or 'no parameters'} (integers >= 1)")
    files = manifest["files"]
    if set(files) != {FAISS_FILE, "docs.bin", "docs.offsets.npy"}:
        raise _bad(folder, f"{MANIFEST}: files lists {', '.join(sorted(files))[:120]}, not {FAISS_FILE}, docs.bin, docs.offsets.npy")
    return manifest


def check_files(folder: Path, manifest: dict) -> None:
    """Every file the manifest lists is there with its size and sha256 (one pass over the files, ~1-2 s per GB)."""
    for name, entry in sorted(manifest["files"].items()):
        path = folder / name
        if not path.is_file():
            raise _bad(folder, f"{name} is missing")
        if path.stat().st_size != entry["bytes"]:
            raise _bad(folder, f"{name} has {path.stat().st_size:,} bytes, the manifest says {entry['bytes']:,}")
        if sha256_file(path) != entry["sha256"]:
            raise _bad(folder, f"{name} was changed since the index was built (sha256 differs from the manifest)")


def _vector_bytes(params: dict[str, Any], dim: int) -> int:
    """The fewest bytes faiss.index spends per vector of the kind: its float32 values (flat, HNSW), and an 8-byte id
    in an inverted list (IVF), or the IVF-PQ code (pq_m bytes) and its id."""
    return {"ivf": 4 * dim + 8, "ivfpq": params.get("pq_m", 1) + 8}.get(params["kind"], 4 * dim)


def check_faiss_header(folder: Path, manifest: dict) -> None:
    """faiss.index's header against the manifest and the file's size, before faiss reads it (faiss allocates what a
    header declares before it reads the bytes): the type code of the manifest's kind, the dimension and vector count
    the manifest records, and a file large enough for that many vectors (`_vector_bytes`). One line otherwise."""
    path = folder / FAISS_FILE
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(16)  # type code, d (int32), ntotal (int64): how every faiss index starts
    kind = manifest["faiss"]["kind"]
    if len(head) < 16 or head[:4] != FOURCC[kind]:
        raise _bad(folder, f"{FAISS_FILE} is not a faiss {kind} index (it starts with {head[:4]!r})")
    dim, rows = int.from_bytes(head[4:8], "little", signed=True), int.from_bytes(head[8:16], "little", signed=True)
    if (rows, dim) != (manifest["rows"], manifest["dim"]):
        raise _bad(folder, f"{FAISS_FILE} declares {rows} vectors of dim {dim}, the manifest says {manifest['rows']} of {manifest['dim']}")
    need = rows * _vector_bytes(manifest["faiss"], dim)
    if need > size:
        raise _bad(folder, f"{FAISS_FILE} declares {rows:,} vectors of dim {dim} (at least {need:,} bytes) but holds {size:,} bytes")


def read_faiss(faiss, path: Path):
    """faiss.read_index(path) with each vector it reads limited to the file's size (faiss >= 1.14.2; a length field
    that says more is refused before anything is allocated), the library's limit restored afterwards."""
    get = getattr(faiss, "get_deserialization_vector_byte_limit", None)
    put = getattr(faiss, "set_deserialization_vector_byte_limit", None)
    if get is None or put is None:  # an older faiss: check_faiss_header's bounds only
        return faiss.read_index(str(path))
    before = get()
    put(max(path.stat().st_size, 1))
    try:
        return faiss.read_index(str(path))
    finally:
        put(before)


class DenseRetriever:
    """`Retriever` over a dense index folder written by `build_dense_index` (thread-safe: one search at a time)."""

    def __init__(self, index, docs, encoder, manifest: dict):
        self.index, self.docs, self.encoder, self.manifest = index, docs, encoder, manifest
        self._lock = threading.Lock()

    @classmethod
    def load(cls, folder: str | Path, device: Optional[str] = None) -> "DenseRetriever":
        """The index in `folder`, validated (manifest, file sizes and hashes, row counts, the encoder's dim)."""
        from emapg_cli.paths import expand
        from emapg_cli.retrieval.docstore import DocStore

        folder = expand(str(folder))
        if not folder.is_dir():
            raise UserError(f"{folder}: no such index folder (build one with `emapg retriever index CORPUS --out DIR --dense MODEL`)")
        manifest = read_manifest(folder)
        faiss = deps()[0]
        check_files(folder, manifest)
        check_faiss_header(folder, manifest)
        try:
            index = read_faiss(faiss, folder / FAISS_FILE)
        except Exception as e:  # noqa: BLE001  faiss raises RuntimeError with a C++ trace
            raise _bad(folder, f"{FAISS_FILE} does not load ({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})") from None
        if index.ntotal != manifest["rows"] or index.d != manifest["dim"]:
            raise _bad(folder, f"{FAISS_FILE} holds {index.ntotal} vectors of dim {index.d}, the manifest says {manifest['rows']} of {manifest['dim']}")
        set_search_params(index, manifest["faiss"])
        docs = DocStore.open(folder)
        if len(docs) != manifest["rows"]:
            docs.close()
            raise _bad(folder, f"the doc store has {len(docs)} rows, the manifest says {manifest['rows']}")
        encoder = load_encoder(manifest["model"], manifest["max_length"], device)
        if dim_of(encoder) != manifest["dim"]:
            docs.close()
            raise _bad(folder, f"the encoder {manifest['model']!r} gives {dim_of(encoder)}-vectors, the index holds {manifest['dim']}")
        return cls(index, docs, encoder, manifest)

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        """Top `topk` documents per query by inner product of the normalised embeddings (fewer when the corpus
        is smaller, or when IVF's probed lists / HNSW's search hold fewer)."""
        if not queries:
            return []
        k = min(topk, self.manifest["rows"])
        with self._lock:
            vectors = encode(self.encoder, list(queries), self.manifest["query_prefix"])  # [n, dim]
            scores, idx = self.index.search(vectors, k)  # [n, k] each; -1 where no hit
            docs = self.docs.get_many([int(i) for i in idx.ravel() if i >= 0])
        found = iter(docs)  # the hits' rows, in the order of idx.ravel()
        return [[hit_from_doc(next(found), float(s)) for i, s in zip(row_i, row_s) if i >= 0]
                for row_i, row_s in zip(idx, scores)]

    def close(self) -> None:
        """Release the doc store's memory map."""
        self.docs.close()
