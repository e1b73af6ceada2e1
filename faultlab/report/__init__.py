"""Reports: replay tables and the HTML page."""
