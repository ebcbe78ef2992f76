"""``kvgate drive``: the closed-loop agent driver over HTTP (see :mod:`kvgate.drive.driver`)."""
