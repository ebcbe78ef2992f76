"""The research commands, above the simulator: the paper's experiments and the index of their pages
(``kvgate experiment``, ``reproduce``, ``report``, ``drain``: :mod:`kvgate.research.experiments`), sweeps, the phase
map and escape times (``kvgate sweep``, ``phase-map``, ``escape``: :mod:`kvgate.research.sweeps`)."""
