"""The two ways every decoding bench asks for tokens: greedy, and sampled as a chat client samples
(issue 57: most real traffic samples, and a sampled row may take another path than a greedy one)."""

from __future__ import annotations

GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.8, "top_p": 0.95}  # a chat client's settings (with a seed where tokens are compared)
CASES = {"greedy": GREEDY, "sampled": SAMPLED}
