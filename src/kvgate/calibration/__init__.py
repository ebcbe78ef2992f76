"""Calibration in one place: the simulated engine checked against the paper's measurements (``paper``), a live
engine measured over HTTP (``measure``) and the cost model's constants fitted to those measurements (``fit``), and
the ``kvgate calibrate`` command. Above the simulator and the driver, which it uses; nothing below imports it."""
