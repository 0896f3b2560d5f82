"""Alembic environment: the URL comes from the caller (``reaper migrate``)."""

from alembic import context
from sqlalchemy import create_engine

url = context.config.get_main_option("sqlalchemy.url")
if url is None:
    raise RuntimeError("the Alembic config names no sqlalchemy.url (reaper migrate sets it)")
engine = create_engine(url)
with engine.connect() as connection:
    context.configure(connection=connection, version_table_schema="public")
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
