"""The data path: what the user gave (``source``), each rank's loader (``loader``), sharded
streams (``streams``), and whether a dataset lives on the device (``residency``)."""
