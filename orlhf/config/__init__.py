"""Flags -> one frozen TrainConfig: flag declarations, OpenRLHF translation (flat and dotted names), validation
(every cross-flag rule once), per-role config slices, the roles registry, fingerprint and redaction. Pure: no Ray,
no model code."""
