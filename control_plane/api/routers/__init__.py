"""One router per resource of the admin API."""
