"""Ordered SQL migrations (NNNN_name.sql), applied once each at start-up by service.database.migrate."""
