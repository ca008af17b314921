"""The commands: `streamload demo | plan | inspect | calibrate`. They sit on the library and
nothing in the library imports them."""
