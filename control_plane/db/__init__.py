"""The control plane's database: models (`models`) and engines/sessions/migrations (`session`)."""
