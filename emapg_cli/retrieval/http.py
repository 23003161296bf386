"""Client for a Search-R1-compatible retrieval server (`POST /retrieve`), e.g. an e5/FAISS wiki-18 server.

Request `{"queries": [str], "topk": int, "return_scores": true}`, response
`{"result": [[{"document": {"contents", ...}, "score": float}, ...] per query]}` (Search-R1
`search_r1/search/retrieval_server.py`). One request per agent turn carries every active episode's
query. Each request has a timeout; a failed request (connection refused, timeout, HTTP 5xx) is
retried with exponential back-off; when every try fails the run stops with a one-line UserError
(checkpoints are written atomically, so the last one stays intact). Standard library only.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from emapg_cli.errors import UserError
from emapg_cli.retrieval.base import Hit, hit_from_doc


class HTTPRetriever:
    """`Retriever` speaking Search-R1's `/retrieve` JSON over HTTP."""

    def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 1.0):
        """`retries`: extra tries after the first; the wait before try i (1-based) is backoff_s * 2**(i - 1)."""
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s

    def _post(self, payload: dict) -> dict:
        data = json.dumps(payload).encode()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=data, headers={"Content-Type": "application/json"}, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return json.loads(response.read().decode("utf-8"))
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code} {e.reason}"
                if e.code < 500:  # the server understood and refused: retrying cannot help
                    break
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last = str(getattr(e, "reason", e)) or type(e).__name__
            except json.JSONDecodeError:
                last = "the reply is not JSON"
                break
        raise UserError(f"retriever {self.url} failed after {attempt + 1} tries: {last}")

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        """One POST for all queries; a reply that does not have Search-R1's shape is a UserError."""
        if not queries:
            return []
        reply = self._post({"queries": list(queries), "topk": topk, "return_scores": True})
        try:
            result = reply["result"]
            if len(result) != len(queries):
                raise ValueError(f"{len(result)} result lists for {len(queries)} queries")
            return [[hit_from_doc(h["document"], h.get("score", 0.0)) for h in hits] for hits in result]
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"retriever {self.url}: unexpected reply ({e}); expected "
                            "{\"result\": [[{\"document\": {\"contents\": ...}, \"score\": ...}]]}") from None

    def close(self) -> None:
        """Nothing held between requests."""
