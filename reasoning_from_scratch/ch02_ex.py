"""The book's chapter 2 exercise index: the streaming generators (imports only)."""

from .book import (
    generate_text_basic,
    generate_text_basic_cache,
    generate_text_basic_stream,
    generate_text_basic_stream_cache,
)
