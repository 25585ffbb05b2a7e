"""Deployment versions: `scale_down_delay_s` may be null, meaning derived by the policy from
the measured cold start (control_plane.autoscale.policy.UNSET_SCALE_DOWN_DELAY_S says what
each policy holds for).

Existing rows at exactly 300 s become null. Until now the API stored 300 s for every version
that gave no delay, so a default cannot be told apart from a user who typed 300; nulling them
lets every deployment that never chose a delay get the derived one (the reason for the
change), and the few that set 300 by hand can set it again (an explicit null in an update
goes back to derived). Any other value was a user's and is kept. The downgrade turns null
back into 300 s, the old default."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations.batch import set_nullable

revision, down_revision = "0020", "0019"

OLD_DEFAULT_S = 300.0


def upgrade() -> None:
    set_nullable("deployment_versions", "scale_down_delay_s", sa.Float(), nullable=True)
    op.execute(
        sa.text(
            "UPDATE deployment_versions SET scale_down_delay_s = NULL WHERE scale_down_delay_s = :d"
        ).bindparams(d=OLD_DEFAULT_S)
    )


def downgrade() -> None:
    op.execute(
        sa.text(
            "UPDATE deployment_versions SET scale_down_delay_s = :d WHERE scale_down_delay_s IS NULL"
        ).bindparams(d=OLD_DEFAULT_S)
    )
    set_nullable("deployment_versions", "scale_down_delay_s", sa.Float(), nullable=False)
