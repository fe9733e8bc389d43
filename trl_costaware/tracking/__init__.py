"""What a run records and how runs are compared: the W&B token axis and the local record (`callbacks`), the record's
file and arm names (`names`), and ``trl-costaware compare`` (`compare`)."""
