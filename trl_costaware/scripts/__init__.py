"""The commands a user types: ``trl-costaware`` (`cli`), its ``train`` recipe script (`train`) and the demo
(`demo`)."""
