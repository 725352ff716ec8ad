"""The decoding core: the decode loops, verification (acceptance rules), proposals (token
trees), sampling, stop conditions and per-generation stats. Imports only ``models``."""
